import math

import numpy as np
import pytest
import reference as ref

import blockhess

# (L, d, d_k, d_v): L != d, d_k != d, d_v != d, L = 1, d = 2
SHAPES = [(1, 2, 2, 2), (1, 3, 2, 4), (2, 2, 3, 2), (4, 3, 5, 3), (5, 4, 2, 4), (3, 4, 4, 6), (7, 5, 3, 5)]
WRT = ["W_Q", "W_K", "W_V", "X"]


def _inputs(rng, L, d, dk, dv):
    X = rng.standard_normal((L, d))
    WQ = rng.standard_normal((d, dk)) / math.sqrt(d)
    WK = rng.standard_normal((d, dk)) / math.sqrt(d)
    WV = rng.standard_normal((d, dv)) / math.sqrt(d)
    return X, WQ, WK, WV


def _autograd_jacobian(X, WQ, WK, WV, wrt):
    args = {"X": X, "W_Q": WQ, "W_K": WK, "W_V": WV}
    names = ("X", "W_Q", "W_K", "W_V")

    def f(w):
        return ref.attention(*(w if n == wrt else ref.t(args[n]) for n in names))

    return ref.jacobian(f, args[wrt])


@pytest.mark.parametrize("L,d,dk,dv", SHAPES)
def test_forward_matches_autograd(rng, L, d, dk, dv):
    X, WQ, WK, WV = _inputs(rng, L, d, dk, dv)
    F = blockhess.attention(X, WQ, WK, WV)
    assert F.shape == (L, dv)
    assert ref.rel_err(F, ref.attention(*map(ref.t, (X, WQ, WK, WV))).numpy()) <= 1e-14


@pytest.mark.parametrize("L,d,dk,dv", SHAPES)
@pytest.mark.parametrize("wrt", WRT)
def test_jacobians_match_autograd(rng, L, d, dk, dv, wrt):
    X, WQ, WK, WV = _inputs(rng, L, d, dk, dv)
    J = blockhess.attention_jacobian(X, WQ, WK, WV, wrt)
    n_wrt = {"W_Q": d * dk, "W_K": d * dk, "W_V": d * dv, "X": L * d}[wrt]
    assert J.shape == (L * dv, n_wrt) and J.dtype == np.float64
    # with one token the softmax is constant, so dF/dW_Q = dF/dW_K = 0 exactly: the centred sums'
    # two products are rounded apart (never fused into one multiply-add), so they cancel to 0
    if L == 1 and wrt in ("W_Q", "W_K"):
        assert not J.any()
        return
    assert ref.rel_err(J, _autograd_jacobian(X, WQ, WK, WV, wrt)) <= 1e-10


def test_peaked_attention(rng):
    # large logits: A is nearly one-hot, where cancellation in the centred sums would show
    X, WQ, WK, WV = _inputs(rng, 6, 4, 3, 4)
    WQ, WK = WQ * 6.0, WK * 6.0
    assert blockhess.softmax(X @ WQ @ WK.T @ X.T / math.sqrt(3)).max() > 0.999
    for wrt in WRT:
        J = blockhess.attention_jacobian(X, WQ, WK, WV, wrt)
        assert ref.rel_err(J, _autograd_jacobian(X, WQ, WK, WV, wrt)) <= 1e-10


@pytest.mark.parametrize("L,d,dk", [(4, 3, 5), (3, 5, 2)])
def test_paper_forms_of_G_Q_G_K_G_V(rng, L, d, dk):
    # docs/derivation.md §3.3 with W_V square (the paper's setting), including erratum E10 (docs/errata.md): K_{d_K, d_V} in G_K
    X, WQ, WK, WV = _inputs(rng, L, d, dk, d)
    A = blockhess.softmax(X @ WQ @ WK.T @ X.T / math.sqrt(dk))
    D_A = blockhess.softmax_jacobian(X @ WQ @ WK.T @ X.T / math.sqrt(dk))
    C = np.kron(np.eye(L), WV.T @ X.T)
    G_Q = C @ D_A @ np.kron(X, X @ WK) / math.sqrt(dk)
    G_K = C @ D_A @ np.kron(X @ WQ, X) @ blockhess.commutation_matrix(dk, d) / math.sqrt(dk)
    G_V = np.kron(A @ X, np.eye(d))
    assert ref.rel_err(blockhess.attention_jacobian(X, WQ, WK, WV, "W_Q"), G_Q) <= 1e-12
    assert ref.rel_err(blockhess.attention_jacobian(X, WQ, WK, WV, "W_K"), G_K) <= 1e-12
    assert ref.rel_err(blockhess.attention_jacobian(X, WQ, WK, WV, "W_V"), G_V) <= 1e-12
    # the commutation matrix as printed ("K_{d_V d_K}") is wrong whenever d_K != d_V
    G_K_printed = C @ D_A @ np.kron(X @ WQ, X) @ blockhess.commutation_matrix(d, dk) / math.sqrt(dk)
    assert ref.rel_err(blockhess.attention_jacobian(X, WQ, WK, WV, "W_K"), G_K_printed) > 0.1


def test_float32_agrees_with_float64(rng):
    X, WQ, WK, WV = _inputs(rng, 6, 5, 3, 4)
    args32 = [a.astype(np.float32) for a in (X, WQ, WK, WV)]
    r32, r64 = blockhess.attention(*args32), blockhess.attention(X, WQ, WK, WV)
    assert r32.dtype == np.float32 and ref.rel_err(r32, r64) <= 1e-4
    for wrt in WRT:
        r32 = blockhess.attention_jacobian(*args32, wrt)
        r64 = blockhess.attention_jacobian(X, WQ, WK, WV, wrt)
        assert r32.dtype == np.float32
        assert ref.rel_err(r32, r64) <= 1e-4, wrt


def test_memory_order_does_not_matter(rng):
    X, WQ, WK, WV = _inputs(rng, 5, 4, 3, 4)
    fortran = [np.asfortranarray(a) for a in (X, WQ, WK, WV)]
    wide = np.zeros((5, 8))
    wide[:, ::2] = X
    for wrt in WRT:
        expected = blockhess.attention_jacobian(X, WQ, WK, WV, wrt)
        np.testing.assert_array_equal(blockhess.attention_jacobian(*fortran, wrt), expected)
        np.testing.assert_array_equal(blockhess.attention_jacobian(wide[:, ::2], WQ, WK, WV, wrt), expected)


def test_bad_input(rng):
    X, WQ, WK, WV = _inputs(rng, 4, 3, 2, 3)
    with pytest.raises(ValueError, match=r"X must be 2-D, got shape \(12,\)"):
        blockhess.attention(X.ravel(), WQ, WK, WV)
    with pytest.raises(ValueError, match=r"W_Q must have shape \(3, d_k\).*X of shape \(4, 3\).*got \(4, 2\)"):
        blockhess.attention(X, np.ones((4, 2)), WK, WV)
    with pytest.raises(ValueError, match=r"W_K must have the shape of W_Q \(3, 2\), got \(3, 5\)"):
        blockhess.attention_jacobian(X, WQ, np.ones((3, 5)), WV, "W_K")
    with pytest.raises(ValueError, match=r"W_V must have shape \(3, d_v\).*got \(2, 3\)"):
        blockhess.attention_jacobian(X, WQ, WK, np.ones((2, 3)), "X")
    with pytest.raises(ValueError, match="wrt"):
        blockhess.attention_jacobian(X, WQ, WK, WV, "W_O")
    for dtype in (np.int32, np.complex64, object):
        with pytest.raises(TypeError, match="float32 or float64"):
            blockhess.attention_jacobian(X.astype(dtype), WQ, WK, WV, "X")
    bad = WV.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="W_V contains NaN or Inf"):
        blockhess.attention_jacobian(X, WQ, WK, bad, "W_Q")
    bad = X.copy()
    bad[1, 1] = np.inf
    with pytest.raises(ValueError, match="X contains NaN or Inf"):
        blockhess.attention(bad, WQ, WK, WV)


def test_dense_request_over_budget_is_refused(rng):
    X, WQ, WK, WV = _inputs(rng, 32, 16, 16, 16)  # dF/dX: (512, 512) doubles = 2 MiB
    with blockhess.memory_budget(2**20):  # plus the working memory of its closed form
        with pytest.raises(MemoryError, match=r"needs 2\.\d\d MiB \(2\.00 MiB for the result.*budget of 1\.00 MiB"):
            blockhess.attention_jacobian(X, WQ, WK, WV, "X")
        assert blockhess.attention(X, WQ, WK, WV).shape == (32, 16)
