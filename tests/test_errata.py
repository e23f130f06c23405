"""The paper's printed formulas that are wrong, each shown numerically (docs/errata.md).

Every test builds the printed form as the paper writes it, with dense Kronecker and commutation
matrices in NumPy (float64, small sizes), and asserts that it is wrong: it disagrees with the exact
object, or its factors do not multiply (NumPy raises ValueError). It then asserts that the corrected
form agrees with blockhess's public API and, where that is cheap, with torch autograd, to 1e-10.

Sizes: L = 3 tokens, d = d_V = 4, d_K = 2, d_ff = 5. They are all different, so every pair of sizes
that the paper swaps gives a different matrix.
"""

from functools import reduce
from types import SimpleNamespace

import numpy as np
import pytest

import blockhess as bh

L, D, DK, DFF = 3, 4, 2, 5
NQ, NV, N1, N2 = D * DK, D * D, D * DFF, DFF * D
I = np.eye
K = bh.commutation_matrix
TOL = 1e-10


def col(A):
    """vec_r(A) as a column, the paper's vec_r inside a Kronecker product."""
    return bh.vec_r(np.asarray(A, dtype=np.float64)).reshape(-1, 1)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def product(*factors):
    """The paper's product of factors, left to right (NumPy raises ValueError on a size mismatch)."""
    return reduce(np.matmul, factors)


def E_diag(n):
    """E_n = [e_1 (x) e_1, ..., e_n (x) e_n] (n^2 x n): d diag(v) / dv."""
    E = np.zeros((n * n, n))
    E[np.arange(n) * (n + 1), np.arange(n)] = 1.0
    return E


def swap_slices(H, n_out, n_i, n_j):
    """(n_out n_i, n_j) -> (n_out n_j, n_i): transpose each output's slice (the true symmetry, E7)."""
    return H.reshape(n_out, n_i, n_j).transpose(0, 2, 1).reshape(n_out * n_j, n_i)


# ---- torch autograd, in the paper's layouts ---------------------------------------------------------


def _torch():
    return pytest.importorskip("torch")


def torch_tensor(a):
    return _torch().tensor(np.asarray(a, dtype=np.float64))


def torch_jacobian(f, args, i):
    """d vec_r f / d vec_r(args[i])^T, shape (f.size, args[i].size)."""
    torch = _torch()
    ts = [torch_tensor(a) for a in args]
    J = torch.func.jacrev(f, argnums=i)(*ts)
    return J.reshape(-1, ts[i].numel()).numpy()


def torch_second(f, args, i, j):
    """d2 f / d args[i] d args[j] in the paper's layout (f.size * args[i].size, args[j].size)."""
    torch = _torch()
    ts = [torch_tensor(a) for a in args]
    H = torch.func.jacrev(torch.func.jacrev(f, argnums=i), argnums=j)(*ts)
    return H.reshape(-1, ts[j].numel()).numpy()


def torch_P(x):
    """P = diag^{-1}(sigma) of the LayerNorm (Thm 2's notation)."""
    torch = _torch()
    m = x - x.mean(1, keepdim=True)
    return torch.diag(1 / torch.sqrt((m**2).mean(1)))


# ---- the problem ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def blk():
    """One sample of the paper's block and the matrices its formulas are written in."""
    rng = np.random.default_rng(11)
    X = rng.standard_normal((L, D))
    params = bh.BlockParams.random(d=D, d_k=DK, d_ff=DFF, seed=3)
    WQ, WK, WV, W1, W2 = (np.asarray(params[n]) for n in ("W_Q", "W_K", "W_V", "W_1", "W_2"))
    S0 = X + bh.attention(X, WQ, WK, WV)
    Y = bh.layernorm(S0)
    H1 = Y @ W1
    assert np.abs(H1).min() > 1e-6  # no pre-activation at the ReLU kink
    S = bh.ffn(Y, W1, W2) + Y
    JY = bh.layernorm_jacobian(S0)
    G = {k: bh.attention_jacobian(X, WQ, WK, WV, f"W_{k}") for k in "QKV"}
    JSY = I(L * D) + bh.ffn_jacobian(Y, W1, W2, "Y")
    B = {k: JSY @ JY @ G[k] for k in "QKV"}
    B["1"], B["2"] = bh.ffn_jacobian(Y, W1, W2, "W_1"), bh.ffn_jacobian(Y, W1, W2, "W_2")
    return SimpleNamespace(
        X=X, params=params, WQ=WQ, WK=WK, WV=WV, W1=W1, W2=W2, S0=S0, Y=Y, S=S, JY=JY, G=G, JSY=JSY, B=B,
        Ds=np.diag(bh.vec_r((H1 > 0).astype(np.float64))), T=X @ WQ @ WK.T @ X.T / np.sqrt(DK),
        JZ=bh.layernorm_jacobian(S), HZ=bh.layernorm_hessian(S), n={"Q": NQ, "K": NQ, "V": NV, "1": N1, "2": N2},
    )


def thm5(b, i, j, xi):
    """Thm 5's boxed H_tr^(i,j) = (J_Z (x) I_{n_i}) xi_ij + (I_{Ld} (x) B_i^T) H_Z B_j."""
    return np.kron(b.JZ, I(b.n[i])) @ xi + np.kron(I(L * D), b.B[i].T) @ b.HZ @ b.B[j]


# ---- LayerNorm (Thm 2, Thm 3): E1, E2, E16 ---------------------------------------------------------


def ln_pieces(X):
    """Thm 8's factors for LN of X (m, q): dP/dX = (1/sqrt q) A_1 B_1, B_1 = E A_2 B_2, B_2 = J A_3 G."""
    m, q = X.shape
    M = X - X.mean(1, keepdims=True)
    sigma = np.sqrt((M**2).mean(1))
    Dinv = np.diag(1 / sigma)
    G = I(m * q) - np.kron(I(m), np.ones((q, q))) / q
    A1 = -np.kron(Dinv, Dinv.T)
    A2 = np.diag(1 / np.sqrt((M**2).sum(1)))
    Jm = np.kron(I(m), np.ones((1, q)))
    A3 = np.diag(bh.vec_r(M))
    B2 = Jm @ A3 @ G
    B1 = E_diag(m) @ A2 @ B2
    H = A1 @ B1 / np.sqrt(q)
    return SimpleNamespace(m=m, q=q, M=M, Dinv=Dinv, G=G, A1=A1, A2=A2, Jm=Jm, B2=B2, B1=B1, H=H)


def dPkronI_printed(p):
    """The Thm 3 proof's d(P (x) I)/dX: L where d_V belongs."""
    m = p.m
    return np.kron(np.kron(I(m), K(m, m)), I(m)) @ np.kron(I(m * m), col(I(m))) @ p.H


def dPkronI_corrected(p):
    m, q = p.m, p.q
    return np.kron(np.kron(I(m), K(q, m)), I(q)) @ np.kron(I(m * m), col(I(q))) @ p.H


def test_E1_dPkronI_uses_d_not_L():
    torch = _torch()
    X = np.random.default_rng(1).standard_normal((L, D))
    p = ln_pieces(X)
    assert rel(p.H, torch_jacobian(torch_P, [X], 0)) < TOL  # Thm 8's dP/dX itself is right
    exact = torch_jacobian(lambda x: torch.kron(torch_P(x), torch.eye(D, dtype=x.dtype)), [X], 0)
    printed = dPkronI_printed(p)
    # Printed: L^4 x L d rows instead of (L d)^2, so Thm 3's term (I_{Ld} (x) G^T) d(P (x) I)/dX cannot be formed.
    assert printed.shape == (L**4, L * D) and exact.shape == ((L * D) ** 2, L * D)
    with pytest.raises(ValueError):
        np.kron(I(L * D), p.G.T) @ printed
    assert rel(dPkronI_corrected(p), exact) < TOL
    # With d_V = L the two forms coincide, which is why the slip goes unnoticed in a square example.
    Xs = np.random.default_rng(2).standard_normal((L, L))
    ps = ln_pieces(Xs)
    exact_square = torch_jacobian(lambda x: torch.kron(torch_P(x), torch.eye(L, dtype=x.dtype)), [Xs], 0)
    assert rel(dPkronI_printed(ps), exact_square) < TOL


def dD_dX(p, scale):
    """dD/dX = E_L A_2 B_2 times ``scale``: the paper prints scale 1, the truth is 1/sqrt(d)."""
    return E_diag(p.m) @ p.A2 @ p.B2 * scale


def d2P_dX2(p, both_scaled):
    """d2P/dX2 = c1 (A_1 (x) I) dB_1/dX + c2 (I (x) B_1^T) dA_1/dX, from Thm 3's proof (with the
    corrected dD/dX and dA_2/dX inside). both_scaled=False is the printed bracketing: 1/sqrt(d) on the
    first term only."""
    m, q = p.m, p.q
    n = m * q
    dD = dD_dX(p, 1 / np.sqrt(q))
    dnegDinv = np.kron(p.Dinv, p.Dinv.T) @ dD
    dDinvT = K(m, m) @ (-np.kron(p.Dinv, p.Dinv.T)) @ dD
    dA1 = np.kron(np.kron(I(m), K(m, m)), I(m)) @ (
        np.kron(I(m * m), col(p.Dinv.T)) @ dnegDinv + np.kron(col(-p.Dinv), I(m * m)) @ dDinvT)
    dA3 = E_diag(n) @ p.G
    dB2 = np.kron(p.Jm, I(n)) @ np.kron(I(n), p.G.T) @ dA3
    dA2 = p.H / np.sqrt(q)  # never given by the paper: A_2 = P / sqrt(d)
    dB1 = np.kron(E_diag(m), I(n)) @ (np.kron(p.A2, I(n)) @ dB2 + np.kron(I(m), p.B2.T) @ dA2)
    first, second = np.kron(p.A1, I(n)) @ dB1, np.kron(I(m * m), p.B1.T) @ dA1
    return (first + second) / np.sqrt(q) if both_scaled else first / np.sqrt(q) + second


def test_E2_dD_dX_and_d2P_brackets():
    torch = _torch()
    X = np.random.default_rng(1).standard_normal((L, D))
    p = ln_pieces(X)
    exact_dD = torch_jacobian(lambda x: torch.diag(1 / torch_P(x).diagonal()), [X], 0)
    # Printed dD/dX is sqrt(d) times the truth, exactly.
    assert rel(dD_dX(p, 1.0), exact_dD) == pytest.approx(np.sqrt(D) - 1, rel=1e-10)
    assert rel(dD_dX(p, 1 / np.sqrt(D)), exact_dD) < TOL
    # dA_2/dX (missing in the paper) is dP/dX / sqrt(d).
    A2 = lambda x: torch.diag(1 / torch.sqrt(((x - x.mean(1, keepdim=True)) ** 2).sum(1)))
    assert rel(p.H / np.sqrt(D), torch_jacobian(A2, [X], 0)) < TOL
    # Printed bracketing of d2P/dX2 is wrong; 1/sqrt(d) on both terms is right.
    exact_d2P = torch_second(torch_P, [X], 0, 0)
    assert rel(d2P_dX2(p, both_scaled=False), exact_d2P) > 0.1
    assert rel(d2P_dX2(p, both_scaled=True), exact_d2P) < TOL
    # With the E1 and E2 fixes, Thm 3's four-term structure is blockhess's LayerNorm Hessian.
    dIM = (np.kron(np.kron(I(L), K(D, L)), I(L)) @ np.kron(col(I(L)), I(L * D)) @ K(D, L) @ p.G)
    thm3 = (np.kron(I(L * D), p.G.T) @ dPkronI_corrected(p)
            + np.kron(np.kron(I(L), p.M.T), I(L * D)) @ d2P_dX2(p, both_scaled=True)
            + np.kron(I(L * D), p.H.T) @ dIM)
    assert rel(thm3, bh.layernorm_hessian(X)) < TOL


def test_E16_relu_indicator_layernorm_axis_and_gamma(blk):
    b = blk
    # Thm 4's indicator 1{X > 0} has L d entries where D_sigma needs L d_ff: B_1 cannot be formed.
    D_X = np.diag(bh.vec_r((b.X > 0).astype(np.float64)))
    with pytest.raises(ValueError):
        product(np.kron(I(L), b.W2.T), D_X, np.kron(b.Y, I(DFF)))
    B1 = product(np.kron(I(L), b.W2.T), b.Ds, np.kron(b.Y, I(DFF)))  # 1{Y W_1 > 0}
    assert rel(B1, bh.ffn_jacobian(b.Y, b.W1, b.W2, "W_1")) < TOL
    # Sec. 2's LayerNorm averages over the m rows; the block's LayerNorm averages over the d_V features.
    X = b.S0
    over_rows = (X - X.mean(0)) / X.std(0)
    over_features = (X - X.mean(1, keepdims=True)) / X.std(1, keepdims=True)
    assert rel(over_rows, bh.layernorm(X)) > 0.1
    assert rel(over_features, bh.layernorm(X)) < TOL
    torch = _torch()
    assert rel(over_features, torch.nn.functional.layer_norm(torch.tensor(X), (D,), eps=0.0).numpy()) < TOL
    # gamma, beta in R^m (m = L) do not fit the feature axis; in R^{d_V} they do.
    with pytest.raises(ValueError):
        bh.layernorm(X, gamma=np.full(L, 2.0))
    with pytest.raises(ValueError):
        over_features * np.full(L, 2.0)
    assert rel(bh.layernorm(X, gamma=np.full(D, 2.0)), 2 * over_features) < TOL


# ---- FFN second derivatives (Thm 5, Thm 10): E3, E4, E5, E6 ----------------------------------------


def torch_ffn(y, w1, w2):
    return _torch().relu(y @ w1) @ w2


def test_E3_xi_12_and_21_labels_swapped(blk):
    b = blk
    printed_12 = product(np.kron(np.kron(I(L), K(D, DFF)), I(D)), np.kron(I(L * DFF), col(I(D))), b.Ds,
                         np.kron(b.Y, I(DFF)))
    xi_12 = bh.ffn_cross_hessian(b.Y, b.W1, b.W2)  # dB_1/dW_2, (L d n_1, n_2)
    xi_21 = swap_slices(xi_12, L * D, N1, N2)  # dB_2/dW_1, (L d n_2, n_1)
    assert printed_12.shape == xi_12.shape  # n_1 = n_2, so only the values tell them apart
    assert rel(printed_12, xi_12) > 0.5
    assert rel(printed_12, xi_21) < TOL
    assert rel(xi_21, torch_second(torch_ffn, [b.Y, b.W1, b.W2], 2, 1)) < TOL


def xi_12_corrected(b, K_last):
    """dB_1/dW_2 = (I_{Ld} (x) (Y (x) I_dff)^T D_sigma)(I_L (x) K_{d,L} (x) I_dff)(vec_r I_L (x) I_{d dff}) K_last."""
    return product(np.kron(I(L * D), np.kron(b.Y, I(DFF)).T @ b.Ds), np.kron(np.kron(I(L), K(D, L)), I(DFF)),
                   np.kron(col(I(L)), I(D * DFF)), K_last)


def test_E4_dB1_dW2_dimensions_and_commutation(blk):
    b = blk
    with pytest.raises(ValueError):  # printed "(2,1)": L d_ff columns meet L d_ff^2 d_V rows
        product(np.kron(I(L), b.W2.T), b.Ds, np.kron(np.kron(I(L), K(DFF, D)), I(DFF)),
                np.kron(I(L * D), col(I(DFF))))
    exact = bh.ffn_cross_hessian(b.Y, b.W1, b.W2)
    assert rel(xi_12_corrected(b, K(DFF, D)), exact) > 0.5  # the proof's K_{d_ff,d_V}
    assert rel(xi_12_corrected(b, K(D, DFF)), exact) < TOL
    assert rel(exact, torch_second(torch_ffn, [b.Y, b.W1, b.W2], 1, 2)) < TOL


def xi_1k_factor(b, n):
    """((I_L (x) W_2^T) D_sigma) (x) I_n: the paper prints n = n_k, the truth is n = n_1."""
    return np.kron(np.kron(I(L), b.W2.T) @ b.Ds, I(n))


def test_E5_xi_1k_kron_identity_n1(blk):
    b = blk
    for k in "QKV":
        rest = (np.kron(np.kron(I(L), K(DFF, D)), I(DFF)), np.kron(I(L * D), col(I(DFF))), b.JY, b.G[k])
        with pytest.raises(ValueError):  # (x) I_{n_k}: n_k != n_1, the factors do not multiply
            product(xi_1k_factor(b, b.n[k]), *rest)
        xi_1k = product(xi_1k_factor(b, N1), *rest)
        exact = bh.block_output_hessian(b.X, b.params, "W_1", f"W_{k}")
        assert rel(thm5(b, "1", k, xi_1k), exact) < TOL


def test_E6_xi_k1_and_k2_derived(blk):
    b = blk
    dJSY_dW1 = product(np.kron(np.kron(I(L), b.W2.T) @ b.Ds, I(L * D)), np.kron(np.kron(I(L), K(DFF, L)), I(D)),
                       np.kron(col(I(L)), I(DFF * D)), K(DFF, D))
    dJSY_dW2 = product(np.kron(I(L * D), (b.Ds @ np.kron(I(L), b.W1.T)).T), np.kron(np.kron(I(L), K(D, L)), I(DFF)),
                       np.kron(col(I(L)), I(D * DFF)), K(D, DFF))
    for k in "QKV":
        Ck = b.JY @ b.G[k]
        xi_1k = product(xi_1k_factor(b, N1), np.kron(np.kron(I(L), K(DFF, D)), I(DFF)),
                        np.kron(I(L * D), col(I(DFF))), Ck)
        # The paper gives no xi_k1, only "symmetry"; reusing xi_1k in H^(k,1) does not even multiply.
        with pytest.raises(ValueError):
            thm5(b, k, "1", xi_1k)
        xi_k1 = np.kron(I(L * D), Ck.T) @ dJSY_dW1
        xi_k2 = np.kron(I(L * D), Ck.T) @ dJSY_dW2
        assert rel(thm5(b, k, "1", xi_k1), bh.block_output_hessian(b.X, b.params, f"W_{k}", "W_1")) < TOL
        assert rel(thm5(b, k, "2", xi_k2), bh.block_output_hessian(b.X, b.params, f"W_{k}", "W_2")) < TOL


def test_E7_symmetry_is_per_output_slice(blk):
    b = blk
    for (i, ni), (j, nj) in ((("W_1", N1), ("W_2", N2)), (("W_Q", NQ), ("W_K", NQ))):
        H_ij = bh.block_output_hessian(b.X, b.params, i, j)
        H_ji = bh.block_output_hessian(b.X, b.params, j, i)
        assert H_ij.shape == H_ji.shape  # n_i = n_j here, so the literal claim can be tested
        assert rel(H_ij, H_ji) > 0.5
        assert rel(swap_slices(H_ij, L * D, ni, nj), H_ji) < TOL
    from blockhess import _torch_reference as ref

    exact = torch_second(lambda *w: ref.block(torch_tensor(b.X), *w), [b.WQ, b.WK, b.WV, b.W1, b.W2], 0, 1)
    assert rel(bh.block_output_hessian(b.X, b.params, "W_Q", "W_K"), exact) < TOL



# ---- attention (Lemma 2, Noci, Ormaniec): E8, E9, E10 ----------------------------------------------


def attention_curvature(X, WQ, WK, WV, T):
    """Lemma 2's pieces: Z_1, Z_2, S (the shuffle matrix) and the Phi_QQ core
    (I_L (x) W_V^T (x) I_d (x) W_K^T) Z_2."""
    Z1 = np.kron(I(L), X.T) @ bh.softmax_jacobian(T) @ np.kron(X, X)
    Z2 = np.kron(np.kron(np.kron(I(L), X.T), X.T), X.T) @ bh.softmax_hessian(T) @ np.kron(X, X)
    S = np.kron(I(D), K(D, D)) @ np.kron(col(I(D)), I(D))
    core = np.kron(np.kron(np.kron(I(L), WV.T), I(D)), WK.T) @ Z2
    return Z1, Z2, S, core


def torch_attention(x, wq, wk, wv):
    from blockhess import _torch_reference as ref

    return ref.attention(x, wq, wk, wv)


def test_E8_Phi_without_loss_factor(blk):
    b = blk
    args = [b.X, b.WQ, b.WK, b.WV]
    Z1, _, S, core = attention_curvature(b.X, b.WQ, b.WK, b.WV, b.T)
    assert S.shape == (D**3, D)  # the paper says d_V^2 x d_V
    c = 2 / (L * D)  # the loss factor Lemma 2 carries into Phi
    # Phi_QQ and Phi_VQ as printed are the truth times 2/(L d_V), exactly.
    exact_QQ = torch_second(torch_attention, args, 1, 1)
    assert rel(c * core @ np.kron(I(D), b.WK) / DK, exact_QQ) == pytest.approx(1 - c, rel=1e-10)
    assert rel(core @ np.kron(I(D), b.WK) / DK, exact_QQ) < TOL
    exact_VQ = torch_second(torch_attention, args, 3, 1)
    VQ = np.kron(I(L), S) @ Z1 @ np.kron(I(D), b.WK) / np.sqrt(DK)
    assert rel(c * VQ, exact_VQ) == pytest.approx(1 - c, rel=1e-10)
    assert rel(VQ, exact_VQ) < TOL
    # Phi_QK's second term: the printed leading I_{d_V} does not multiply (Z_1 (x) I_{d_V}); I_L does.
    with pytest.raises(ValueError):
        np.kron(np.kron(I(D), b.WV.T), I(D)) @ np.kron(Z1, I(D))
    second = np.kron(np.kron(np.kron(I(L), b.WV.T), I(D)) @ np.kron(Z1, I(D)) @ S, I(DK)) / np.sqrt(DK)
    QK = core @ np.kron(b.WQ, I(D)) @ K(DK, D) / DK + second
    assert rel(QK, torch_second(torch_attention, args, 1, 2)) < TOL


def test_E9_uniform_attention_Phi_do_not_vanish():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((L, D))
    # Rows of Q = X W_Q and K = X W_K in orthogonal directions of R^{d_K}: T = Q K^T / sqrt(d_K) = 0,
    # so the attention is exactly uniform while W_Q, W_K and the logits' derivatives are not zero.
    WQ = np.outer(rng.standard_normal(D), [1.0, 0.0])
    WK = np.outer(rng.standard_normal(D), [0.0, 1.0])
    WV = rng.standard_normal((D, D))
    T = X @ WQ @ WK.T @ X.T / np.sqrt(DK)
    assert np.abs(T).max() < 1e-14
    # Noci's uniform softmax Jacobian has the prefactor 1/L; the printed 1/n (n = d_V, say) does not fit.
    uniform = np.kron(I(L), I(L) - np.ones((L, L)) / L)
    assert rel(uniform / D, bh.softmax_jacobian(T)) == pytest.approx(1 - L / D, rel=1e-10)
    assert rel(uniform / L, bh.softmax_jacobian(T)) < TOL
    # The paper: under uniform attention Phi_VQ = Phi_VK = Phi_QQ = Phi_KK = 0. Autograd: none of them is.
    args = [X, WQ, WK, WV]
    for i, j in ((3, 1), (3, 2), (1, 1), (2, 2)):
        Phi = torch_second(torch_attention, args, i, j)
        assert np.linalg.norm(Phi) > 1e-2
    assert np.linalg.norm(bh.attention_jacobian(X, WQ, WK, WV, "W_Q")) > 1e-2  # nor is G_Q
    # The general (corrected) Phi_QQ holds at uniform attention too.
    _, _, _, core = attention_curvature(X, WQ, WK, WV, T)
    assert rel(core @ np.kron(I(D), WK) / DK, torch_second(torch_attention, args, 1, 1)) < TOL


def test_E10_G_K_commutation(blk):
    b = blk
    front = np.kron(I(L), b.WV.T @ b.X.T) @ bh.softmax_jacobian(b.T) @ np.kron(b.X @ b.WQ, b.X) / np.sqrt(DK)
    exact = bh.attention_jacobian(b.X, b.WQ, b.WK, b.WV, "W_K")
    printed_err = rel(front @ K(D, DK), exact)  # the printed K_{d_V d_K}
    assert printed_err > 1.0
    assert rel(front @ K(DK, D), exact) < TOL
    assert rel(exact, torch_jacobian(torch_attention, [b.X, b.WQ, b.WK, b.WV], 2)) < TOL


# ---- the loss (Eq. 7, Lemma 2, Sec. 2): E13 ---------------------------------------------------------


def test_E13_loss_normalisation(blk):
    b = blk
    from blockhess import _torch_reference as ref

    target = np.random.default_rng(9).standard_normal((L, D))
    H = bh.loss_hessian(b.X, target, b.params)
    weights = [b.WQ, b.WK, b.WV, b.W1, b.W2]
    shapes = [w.shape for w in weights]
    x, t = torch_tensor(b.X), torch_tensor(target)
    flat = torch_tensor(np.concatenate([w.reshape(-1) for w in weights]))
    torch = _torch()

    def hessian_of(reduce_sq):
        f = lambda v: reduce_sq((ref.block(x, *ref.unflatten(v, shapes)) - t) ** 2)
        return torch.func.hessian(f)(flat).numpy()

    assert rel(hessian_of(lambda q: q.mean()), H) < TOL  # (1/(L d)) ||Z - T||_F^2
    assert rel(hessian_of(lambda q: q.sum()), H) == pytest.approx(L * D - 1, rel=1e-9)  # ||.||^2
    assert rel(hessian_of(lambda q: q.sum() / 2), H) == pytest.approx(L * D / 2 - 1, rel=1e-9)  # 1/2 ||.||^2
    # R^tr = vec_r(Z - T)^T (x) I lacks 2/(L d): the functional (1,2) block is off by L d / 2.
    r = bh.vec_r(bh.block_forward(b.X, b.params) - target).reshape(1, -1)
    R_printed = np.kron(r, I(N1)) @ bh.block_output_hessian(b.X, b.params, "W_1", "W_2")
    functional = bh.loss_hessian(b.X, target, b.params, part="functional", layout="blocks")["W_1", "W_2"]
    assert rel(R_printed, functional) == pytest.approx(L * D / 2 - 1, rel=1e-9)
    assert rel(2 / (L * D) * R_printed, functional) < TOL
