import numpy as np
import pytest
import reference as ref

import blockhess

DIMS = [(1, 1), (1, 4), (2, 3), (3, 2), (4, 5), (6, 6)]


@pytest.mark.parametrize("m,n", DIMS)
def test_commutation_matrix_matches_definition(m, n):
    K = blockhess.commutation_matrix(m, n)
    assert K.shape == (m * n, m * n) and K.dtype == np.float64
    np.testing.assert_array_equal(K, ref.commutation_from_definition(m, n))
    # the explicit index form of docs/derivation.md §1.2
    rows = [i * n + j for i in range(m) for j in range(n)]
    cols = [j * m + i for i in range(m) for j in range(n)]
    expected = np.zeros((m * n, m * n))
    expected[rows, cols] = 1.0
    np.testing.assert_array_equal(K, expected)
    np.testing.assert_array_equal(blockhess.commutation_permutation(m, n), K.argmax(axis=1))
    assert blockhess.commutation_matrix(m, n, dtype=np.float32).dtype == np.float32


@pytest.mark.parametrize("m,n", DIMS)
def test_commutation_identities(rng, m, n):
    A = rng.standard_normal((m, n))
    K_mn, K_nm = blockhess.commutation_matrix(m, n), blockhess.commutation_matrix(n, m)
    np.testing.assert_array_equal(K_nm @ K_mn, np.eye(m * n))
    np.testing.assert_array_equal(K_mn @ A.reshape(-1, order="F"), A.T.reshape(-1, order="F"))
    np.testing.assert_array_equal(K_nm @ blockhess.vec_r(A), blockhess.vec_r(A.T))
    # Prop 9: d A^T / d A = K_{n,m}, checked with autograd
    np.testing.assert_array_equal(ref.jacobian(lambda a: a.T, A), K_nm)


@pytest.mark.parametrize("m,n", DIMS)
@pytest.mark.parametrize("cols", [None, 1, 3])
def test_commute_matches_dense(rng, m, n, cols):
    shape = (m * n,) if cols is None else (m * n, cols)
    v = rng.standard_normal(shape)
    out = blockhess.commute(v, m, n)
    assert out.shape == shape
    np.testing.assert_array_equal(out, blockhess.commutation_matrix(m, n) @ v)
    A = rng.standard_normal((m, n))
    np.testing.assert_array_equal(blockhess.commute(blockhess.vec_r(A), n, m), blockhess.vec_r(A.T))
    np.testing.assert_array_equal(blockhess.commute(blockhess.commute(v, m, n), n, m), v)


@pytest.mark.parametrize("p,m,q,n", [(1, 1, 1, 1), (2, 3, 4, 5), (5, 2, 3, 1), (3, 3, 3, 3), (1, 6, 7, 2)])
def test_kron_apply_matches_np_kron(rng, p, m, q, n):
    A, B, X = rng.standard_normal((p, m)), rng.standard_normal((q, n)), rng.standard_normal((m, n))
    y = blockhess.kron_apply(A, B, X)
    assert y.shape == (p * q,)
    assert ref.rel_err(y, np.kron(A, B) @ X.reshape(-1)) <= 1e-13
    assert ref.rel_err(y, (A @ X @ B.T).reshape(-1)) <= 1e-13
    np.testing.assert_array_equal(blockhess.kron_apply(A, B, X.reshape(-1)), y)
    # product vectorisation (docs/derivation.md §1.3): d vec_r(A X B^T) / d vec_r X = A (x) B, from autograd
    J = ref.jacobian(lambda x: ref.t(A) @ x @ ref.t(B).T, X)
    assert ref.rel_err(np.kron(A, B), J) <= 1e-15


def test_vec_r_and_unvec_r(rng):
    A = rng.standard_normal((3, 4))
    v = blockhess.vec_r(A)
    np.testing.assert_array_equal(v, A.reshape(-1))
    assert not np.shares_memory(v, A)
    np.testing.assert_array_equal(blockhess.unvec_r(v, 3, 4), A)
    np.testing.assert_array_equal(blockhess.vec_r(np.asfortranarray(A)), v)
    np.testing.assert_array_equal(blockhess.vec_r(A.T), A.T.reshape(-1))


def test_float32_is_kept(rng):
    A, B, X = rng.standard_normal((3, 2)), rng.standard_normal((4, 5)), rng.standard_normal((2, 5))
    y32 = blockhess.kron_apply(A.astype(np.float32), B.astype(np.float32), X.astype(np.float32))
    assert y32.dtype == np.float32
    assert ref.rel_err(y32, blockhess.kron_apply(A, B, X)) <= 1e-6
    v = rng.standard_normal(12).astype(np.float32)
    out = blockhess.commute(v, 3, 4)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, v[blockhess.commutation_permutation(3, 4)])
    assert blockhess.vec_r(A.astype(np.float32)).dtype == np.float32
    # mixed precision promotes to float64
    assert blockhess.kron_apply(A.astype(np.float32), B, X).dtype == np.float64


def test_memory_order_does_not_matter(rng):
    A, B, X = rng.standard_normal((3, 4)), rng.standard_normal((2, 5)), rng.standard_normal((4, 5))
    expected = blockhess.kron_apply(A, B, X)
    np.testing.assert_array_equal(
        blockhess.kron_apply(np.asfortranarray(A), np.asfortranarray(B), np.asfortranarray(X)), expected
    )
    wide = np.zeros((4, 10))
    wide[:, ::2] = X
    np.testing.assert_array_equal(blockhess.kron_apply(A, B, wide[:, ::2]), expected)
    V = rng.standard_normal((12, 3))
    np.testing.assert_array_equal(blockhess.commute(np.asfortranarray(V), 3, 4), blockhess.commute(V, 3, 4))
    np.testing.assert_array_equal(blockhess.commute(V[:, 1], 3, 4), blockhess.commute(V, 3, 4)[:, 1])


def test_bad_input():
    with pytest.raises(ValueError, match=r"m\*n = 12 rows .*shape \(11,\)"):
        blockhess.commute(np.ones(11), 3, 4)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        blockhess.commute(np.ones((12, 1, 1)), 3, 4)
    with pytest.raises(ValueError, match="m must be >= 1"):
        blockhess.commutation_matrix(0, 3)
    with pytest.raises(TypeError, match="integer"):
        blockhess.commutation_matrix(2.5, 3)
    with pytest.raises(TypeError, match="integer"):
        blockhess.commute(np.ones(4), True, 4)
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.commutation_matrix(2, 3, dtype=np.int64)
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.commute(np.arange(12), 3, 4)
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.vec_r(np.ones((2, 2), dtype=np.complex128))
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.kron_apply(np.ones((2, 2), dtype=object), np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.commute(np.array([1.0, np.nan]), 1, 2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.kron_apply(np.ones((2, 2)), np.ones((2, 2)), np.full((2, 2), np.inf))
    with pytest.raises(ValueError, match=r"X must have shape \(3, 4\) or \(12,\).*\(2, 3\).*\(5, 4\).*got \(4, 3\)"):
        blockhess.kron_apply(np.ones((2, 3)), np.ones((5, 4)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="2-D"):
        blockhess.kron_apply(np.ones(3), np.ones((5, 4)), np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"v must have shape \(6,\)"):
        blockhess.unvec_r(np.ones(5), 2, 3)
    with pytest.raises(ValueError, match="2-D"):
        blockhess.vec_r(np.ones(3))


def test_dense_request_over_budget_is_refused():
    with blockhess.memory_budget(2**20):
        with pytest.raises(MemoryError, match="commute"):
            blockhess.commutation_matrix(20, 20)
        assert blockhess.commute(np.ones(400), 20, 20).shape == (400,)
