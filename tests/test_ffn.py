import numpy as np
import pytest
import reference as ref

import blockhess

# (L, d, d_ff, d_out): L != d, d_ff != d, d_out != d, L = 1, d = 2
SHAPES = [(1, 2, 3, 2), (1, 3, 2, 3), (3, 2, 2, 2), (4, 3, 5, 3), (2, 5, 3, 5), (5, 4, 6, 3), (6, 2, 7, 2)]


def _inputs(rng, L, d, f, e):
    return rng.standard_normal((L, d)), rng.standard_normal((d, f)), rng.standard_normal((f, e))


def _autograd_jacobian(Y, W1, W2, wrt):
    args = {"Y": Y, "W_1": W1, "W_2": W2}
    names = ("Y", "W_1", "W_2")
    return ref.jacobian(lambda w: ref.ffn(*(w if n == wrt else ref.t(args[n]) for n in names)), args[wrt])


def _autograd_cross(Y, W1, W2):
    return ref.cross_second_derivative(lambda a, b: ref.ffn(ref.t(Y), a, b), W1, W2)


@pytest.mark.parametrize("L,d,f,e", SHAPES)
def test_forward_and_jacobians_match_autograd(rng, L, d, f, e):
    Y, W1, W2 = _inputs(rng, L, d, f, e)
    F = blockhess.ffn(Y, W1, W2)
    assert F.shape == (L, e)
    assert ref.rel_err(F, ref.ffn(*map(ref.t, (Y, W1, W2))).numpy()) <= 1e-14
    shapes = {"W_1": (L * e, d * f), "W_2": (L * e, f * e), "Y": (L * e, L * d)}
    for wrt, shape in shapes.items():
        J = blockhess.ffn_jacobian(Y, W1, W2, wrt)
        assert J.shape == shape and J.dtype == np.float64
        assert ref.rel_err(J, _autograd_jacobian(Y, W1, W2, wrt), 1e-300) <= 1e-10, wrt
    J = blockhess.ffn_jacobian(Y, W1, W2, "Y")
    blocks = blockhess.ffn_jacobian(Y, W1, W2, "Y", layout="blocks")
    assert blocks.shape == (L, e, d)
    J4 = J.reshape(L, e, L, d)
    for t in range(L):
        np.testing.assert_array_equal(blocks[t], J4[t, :, t, :])
        J4[t, :, t, :] = 0
    assert not J4.any()


@pytest.mark.parametrize("L,d,f,e", SHAPES)
def test_cross_hessian_matches_autograd(rng, L, d, f, e):
    Y, W1, W2 = _inputs(rng, L, d, f, e)
    H = blockhess.ffn_cross_hessian(Y, W1, W2)
    assert H.shape == (L * e * d * f, f * e)
    H_ref = _autograd_cross(Y, W1, W2)
    scale = 1.0 if not H_ref.any() else 1e-300  # every unit may be off for tiny shapes
    assert ref.rel_err(H, H_ref, scale) <= 1e-10
    C = blockhess.ffn_cross_hessian(Y, W1, W2, layout="blocks")
    assert C.shape == (L, d, f)
    H6 = H.reshape(L, e, d, f, f, e)
    for c in range(e):
        for g in range(f):
            np.testing.assert_array_equal(H6[:, c, :, g, g, c], C[:, :, g])
            H6[:, c, :, g, g, c] = 0
    assert not H6.any()


def test_other_second_derivatives_are_zero(rng):
    # what ffn_cross_hessian's docstring promises: (W_1, W_1) and (W_2, W_2) vanish (ReLU'' = 0)
    Y, W1, W2 = _inputs(rng, 3, 4, 5, 4)
    assert not ref.second_derivative(lambda w: ref.ffn(ref.t(Y), w, ref.t(W2)), W1).any()
    assert not ref.second_derivative(lambda w: ref.ffn(ref.t(Y), ref.t(W1), w), W2).any()


def test_relu_derivative_at_zero_is_zero(rng):
    Y, W1, W2 = _inputs(rng, 4, 3, 5, 3)
    W1[:, 2] = 0.0  # pre-activations of unit 2 are exactly 0
    Y[1] = 0.0  # and so is every pre-activation of token 1
    J1 = blockhess.ffn_jacobian(Y, W1, W2, "W_1").reshape(4, 3, 3, 5)
    assert not J1[:, :, :, 2].any() and not J1[1].any()
    JY = blockhess.ffn_jacobian(Y, W1, W2, "Y", layout="blocks")
    assert not JY[1].any()
    C = blockhess.ffn_cross_hessian(Y, W1, W2, layout="blocks")
    assert not C[:, :, 2].any()
    # the same convention as PyTorch's relu
    for wrt in ("W_1", "W_2", "Y"):
        assert ref.rel_err(blockhess.ffn_jacobian(Y, W1, W2, wrt), _autograd_jacobian(Y, W1, W2, wrt)) <= 1e-14
    assert ref.rel_err(blockhess.ffn_cross_hessian(Y, W1, W2), _autograd_cross(Y, W1, W2)) <= 1e-14


@pytest.mark.parametrize("L,d,f", [(3, 2, 4), (2, 4, 3)])
def test_paper_forms_of_B_1_B_2_and_xi_12(rng, L, d, f):
    # docs/derivation.md §3.4 and the corrected xi_12 = dB_1/dW_2 (docs/errata.md E4), with d_out = d
    Y, W1, W2 = _inputs(rng, L, d, f, d)
    K = blockhess.commutation_matrix
    H = Y @ W1
    D = np.diag((H > 0).reshape(-1).astype(float))
    I = np.eye
    B_1 = np.kron(I(L), W2.T) @ D @ np.kron(Y, I(f))
    B_2 = np.kron(np.maximum(H, 0), I(d))
    xi_12 = (
        np.kron(I(L * d), np.kron(Y, I(f)).T @ D)
        @ np.kron(np.kron(I(L), K(d, L)), I(f))
        @ np.kron(I(L).reshape(-1, 1), I(d * f))
        @ K(d, f)
    )
    assert ref.rel_err(blockhess.ffn_jacobian(Y, W1, W2, "W_1"), B_1) <= 1e-14
    assert ref.rel_err(blockhess.ffn_jacobian(Y, W1, W2, "W_2"), B_2) <= 1e-14
    np.testing.assert_array_equal(blockhess.ffn_cross_hessian(Y, W1, W2), xi_12)


def test_float32_agrees_with_float64(rng):
    Y, W1, W2 = _inputs(rng, 5, 4, 6, 3)
    args32 = [a.astype(np.float32) for a in (Y, W1, W2)]
    r32, r64 = blockhess.ffn(*args32), blockhess.ffn(Y, W1, W2)
    assert r32.dtype == np.float32 and ref.rel_err(r32, r64) <= 1e-4
    for wrt in ("W_1", "W_2", "Y"):
        r32 = blockhess.ffn_jacobian(*args32, wrt)
        assert r32.dtype == np.float32
        assert ref.rel_err(r32, blockhess.ffn_jacobian(Y, W1, W2, wrt)) <= 1e-4, wrt
    r32 = blockhess.ffn_cross_hessian(*args32)
    assert r32.dtype == np.float32 and ref.rel_err(r32, blockhess.ffn_cross_hessian(Y, W1, W2)) <= 1e-4


def test_memory_order_does_not_matter(rng):
    Y, W1, W2 = _inputs(rng, 5, 4, 6, 3)
    fortran = [np.asfortranarray(a) for a in (Y, W1, W2)]
    wide = np.zeros((4, 12))
    wide[:, ::2] = W1
    for wrt in ("W_1", "W_2", "Y"):
        expected = blockhess.ffn_jacobian(Y, W1, W2, wrt)
        np.testing.assert_array_equal(blockhess.ffn_jacobian(*fortran, wrt), expected)
        np.testing.assert_array_equal(blockhess.ffn_jacobian(Y, wide[:, ::2], W2, wrt), expected)
    np.testing.assert_array_equal(blockhess.ffn_cross_hessian(*fortran), blockhess.ffn_cross_hessian(Y, W1, W2))


def test_bad_input(rng):
    Y, W1, W2 = _inputs(rng, 4, 3, 5, 3)
    with pytest.raises(ValueError, match=r"Y must be 2-D, got shape \(2, 2, 3\)"):
        blockhess.ffn(Y[None].reshape(2, 2, 3), W1, W2)
    with pytest.raises(ValueError, match=r"W_1 must have shape \(3, d_ff\).*Y of shape \(4, 3\).*got \(4, 5\)"):
        blockhess.ffn_jacobian(Y, np.ones((4, 5)), W2, "W_1")
    with pytest.raises(ValueError, match=r"W_2 must have shape \(5, d_out\).*W_1 of shape \(3, 5\).*got \(3, 3\)"):
        blockhess.ffn_cross_hessian(Y, W1, np.ones((3, 3)))
    with pytest.raises(ValueError, match="wrt"):
        blockhess.ffn_jacobian(Y, W1, W2, "b_1")
    with pytest.raises(ValueError, match="blocks"):
        blockhess.ffn_jacobian(Y, W1, W2, "W_1", layout="blocks")
    for dtype in (np.int64, np.complex128, object):
        with pytest.raises(TypeError, match="float32 or float64"):
            blockhess.ffn_jacobian(Y, W1, W2.astype(dtype), "Y")
    bad = W1.copy()
    bad[2, 2] = np.nan
    with pytest.raises(ValueError, match="W_1 contains NaN or Inf"):
        blockhess.ffn_cross_hessian(Y, bad, W2)


def test_dense_request_over_budget_is_refused(rng):
    Y, W1, W2 = _inputs(rng, 8, 8, 8, 8)  # dense cross Hessian: 4096 x 64 doubles = 2 MiB
    with blockhess.memory_budget(2**20):
        with pytest.raises(MemoryError, match='layout="blocks"'):
            blockhess.ffn_cross_hessian(Y, W1, W2)
        assert blockhess.ffn_cross_hessian(Y, W1, W2, layout="blocks").shape == (8, 8, 8)


@pytest.mark.parametrize("wrt", ["W_1", "W_2"])
@pytest.mark.parametrize("L,d,d_ff,d_out", [(4, 3, 5, 3), (1, 2, 6, 4), (6, 5, 4, 2)])
def test_kron_factors_rebuild_the_jacobian(rng, wrt, L, d, d_ff, d_out):
    Y = rng.standard_normal((L, d))
    W1 = rng.standard_normal((d, d_ff))
    W2 = rng.standard_normal((d_ff, d_out))
    U, V = blockhess.ffn_jacobian(Y, W1, W2, wrt, layout="kron")
    n_first = d if wrt == "W_1" else d_ff
    n_second = d_ff if wrt == "W_1" else d_out
    assert U.shape == (L, n_first) and V.shape == (L, d_out, n_second)
    J = np.einsum("tp,tcq->tcpq", U, V).reshape(L * d_out, n_first * n_second)
    np.testing.assert_array_equal(J, blockhess.ffn_jacobian(Y, W1, W2, wrt))

    def fn(w):
        ws = [ref.t(W1), ref.t(W2)]
        ws[0 if wrt == "W_1" else 1] = w
        return ref.ffn(ref.t(Y), *ws)

    assert ref.rel_err(J, ref.jacobian(fn, W1 if wrt == "W_1" else W2)) <= 1e-12
    U32, V32 = blockhess.ffn_jacobian(Y.astype(np.float32), W1.astype(np.float32), W2.astype(np.float32), wrt,
                                      layout="kron")
    assert U32.dtype == V32.dtype == np.float32


def test_kron_layout_is_for_the_weights_only(rng):
    Y, W1, W2 = rng.standard_normal((3, 4)), rng.standard_normal((4, 5)), rng.standard_normal((5, 4))
    with pytest.raises(ValueError, match='layout="blocks"'):
        blockhess.ffn_jacobian(Y, W1, W2, "Y", layout="kron")
