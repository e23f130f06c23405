import numpy as np
import pytest
import reference as ref

import blockhess

SHAPES = [(1, 1), (1, 2), (2, 2), (3, 3), (4, 2), (2, 5), (6, 6)]


def _logits(rng, m, n):
    return rng.standard_normal((m, n)) * 2.0


@pytest.mark.parametrize("m,n", SHAPES)
def test_forward_jacobian_hessian_match_autograd(rng, m, n):
    T = _logits(rng, m, n)
    scale = 1.0 if n == 1 else 1e-300  # with n = 1 softmax is constant: the derivatives are 0
    assert ref.rel_err(blockhess.softmax(T), ref.softmax_rows(ref.t(T)).numpy()) <= 1e-14

    J = blockhess.softmax_jacobian(T)
    assert J.shape == (m * n, m * n)
    assert ref.rel_err(J, ref.jacobian(ref.softmax_rows, T), scale) <= 1e-10
    blocks = blockhess.softmax_jacobian(T, layout="blocks")
    assert blocks.shape == (m, n, n)
    for i in range(m):
        np.testing.assert_array_equal(blocks[i], J[i * n:(i + 1) * n, i * n:(i + 1) * n])

    H = blockhess.softmax_hessian(T)
    N = m * n
    assert H.shape == (N * N, N)
    assert ref.rel_err(H, ref.second_derivative(ref.softmax_rows, T), scale) <= 1e-10
    Hb = blockhess.softmax_hessian(T, layout="blocks")
    assert Hb.shape == (m, n, n, n)
    H6 = H.reshape(m, n, m, n, m, n)
    for i in range(m):
        np.testing.assert_array_equal(Hb[i], H6[i, :, i, :, i, :])
    off = H6.copy()
    for i in range(m):
        off[i, :, i, :, i, :] = 0
    assert not off.any()
    np.testing.assert_array_equal(Hb, Hb.transpose(0, 1, 3, 2))  # symmetric, bit for bit


def test_lemma_c1_block_form(rng):
    # Ormaniec Lemma C.1 (docs/derivation.md §3.2), written out with numpy
    T = _logits(rng, 3, 4)
    A = blockhess.softmax(T)
    Hb = blockhess.softmax_hessian(T, layout="blocks")
    I = np.eye(4)
    for i in range(3):
        a = A[i]
        for j in range(4):
            e = I[j]
            expected = a[j] * (2 * np.outer(a, a) + np.outer(e, e) - np.diag(a) - np.outer(e, a) - np.outer(a, e))
            assert ref.rel_err(Hb[i, j], expected) <= 1e-14


def test_large_logits_are_stable(rng):
    T = _logits(rng, 3, 5)
    big = T + 1000.0  # exp(1000) overflows without the max shift; softmax is shift invariant
    A = blockhess.softmax(big)
    assert np.isfinite(A).all()
    assert ref.rel_err(A, blockhess.softmax(T)) <= 1e-12
    H = blockhess.softmax_hessian(big)
    assert np.isfinite(H).all()
    assert ref.rel_err(H, ref.second_derivative(ref.softmax_rows, big)) <= 1e-10
    assert ref.rel_err(H, blockhess.softmax_hessian(T)) <= 1e-11


def test_float32_agrees_with_float64(rng):
    T = _logits(rng, 5, 7)
    for fn in (
        blockhess.softmax,
        blockhess.softmax_jacobian,
        lambda x: blockhess.softmax_hessian(x, layout="blocks"),
        blockhess.softmax_hessian,
    ):
        r32, r64 = fn(T.astype(np.float32)), fn(T)
        assert r32.dtype == np.float32 and r64.dtype == np.float64
        assert ref.rel_err(r32, r64) <= 1e-4


def test_layout_independent_of_memory_order(rng):
    T = _logits(rng, 4, 6)
    expected = blockhess.softmax_hessian(T, layout="blocks")
    np.testing.assert_array_equal(blockhess.softmax_hessian(np.asfortranarray(T), layout="blocks"), expected)
    wide = np.zeros((4, 12))
    wide[:, ::2] = T
    np.testing.assert_array_equal(blockhess.softmax_hessian(wide[:, ::2], layout="blocks"), expected)
    np.testing.assert_array_equal(blockhess.softmax_jacobian(T.T.copy().T), blockhess.softmax_jacobian(T))


def test_bad_input():
    good = np.arange(12.0).reshape(3, 4) / 7
    with pytest.raises(ValueError, match=r"T must be 2-D, got shape \(12,\)"):
        blockhess.softmax_jacobian(good.ravel())
    with pytest.raises(ValueError, match=r"T must be 2-D, got shape \(1, 3, 4\)"):
        blockhess.softmax_hessian(good[None])
    with pytest.raises(ValueError, match=r"got \(0, 4\)"):
        blockhess.softmax(np.zeros((0, 4)))
    for dtype in (np.int64, np.complex128, object, np.float16):
        with pytest.raises(TypeError, match="float32 or float64"):
            blockhess.softmax_jacobian(good.astype(dtype))
    bad = good.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.softmax_hessian(bad)
    bad[2, 1] = -np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.softmax(bad)
    with pytest.raises(ValueError, match="layout"):
        blockhess.softmax_jacobian(good, layout="sparse")


def test_dense_request_over_budget_is_refused():
    T = np.random.default_rng(1).standard_normal((8, 8))  # dense Hessian: 64^3 doubles = 2 MiB
    with blockhess.memory_budget(2**20):
        with pytest.raises(MemoryError, match='layout="blocks"'):
            blockhess.softmax_hessian(T)
        assert blockhess.softmax_hessian(T, layout="blocks").shape == (8, 8, 8, 8)
    with blockhess.memory_budget(2**14):
        with pytest.raises(ValueError, match=r"KiB.*budget of 16.0 KiB"):
            blockhess.softmax_jacobian(T)
