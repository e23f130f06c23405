import numpy as np
import pytest
import reference as ref

import blockhess

SHAPES = [(1, 2), (3, 4), (5, 3), (2, 7), (8, 16)]


def _inputs(rng, L, d, affine):
    X = rng.standard_normal((L, d)) * 1.5 + 0.3
    gamma = rng.standard_normal(d) if affine else None
    beta = rng.standard_normal(d) if affine else None
    return X, gamma, beta


def _ref_fn(eps, gamma, beta=None):
    g = None if gamma is None else ref.t(gamma)
    b = None if beta is None else ref.t(beta)
    return lambda X: ref.layernorm(X, eps, g, b)


@pytest.mark.parametrize("L,d", SHAPES)
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", [False, True])
def test_forward_jacobian_hessian_match_autograd(rng, L, d, eps, affine):
    X, gamma, beta = _inputs(rng, L, d, affine)
    f = _ref_fn(eps, gamma, beta)
    scale = 1.0 if d == 2 else 1e-300  # with d = 2 the output is constant: the derivatives are 0
    assert ref.rel_err(blockhess.layernorm(X, eps, gamma, beta), f(ref.t(X)).numpy()) <= 1e-13

    J_ref = ref.jacobian(f, X)
    J = blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma)
    assert J.shape == (L * d, L * d)
    assert ref.rel_err(J, J_ref, scale) <= 1e-10
    blocks = blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma, layout="blocks")
    for i in range(L):
        np.testing.assert_array_equal(blocks[i], J[i * d:(i + 1) * d, i * d:(i + 1) * d])

    H_ref = ref.second_derivative(f, X)
    H = blockhess.layernorm_hessian(X, eps=eps, gamma=gamma)
    assert H.shape == ((L * d) ** 2, L * d)
    assert ref.rel_err(H, H_ref, scale) <= 1e-10
    Hb = blockhess.layernorm_hessian(X, eps=eps, gamma=gamma, layout="blocks")
    H4 = H.reshape(L, d, L, d, L, d)
    for i in range(L):
        np.testing.assert_array_equal(Hb[i], H4[i, :, i, :, i, :])
    # symmetric in the two input indices, bit for bit
    np.testing.assert_array_equal(Hb, Hb.transpose(0, 1, 3, 2))


@pytest.mark.parametrize("L,d", [(1, 2), (4, 6), (6, 3)])
def test_hessian_contract_matches_autograd(rng, L, d):
    X, gamma, _ = _inputs(rng, L, d, True)
    G = rng.standard_normal((L, d))
    f = _ref_fn(1e-4, gamma)
    H_ref = ref.second_derivative(lambda x: (f(x) * ref.t(G)).sum(), X)  # (Ld, Ld)
    C = blockhess.layernorm_hessian_contract(X, G, eps=1e-4, gamma=gamma)
    assert C.shape == (L, d, d)
    H_ref = H_ref.reshape(L, d, L, d)
    assert ref.rel_err(C, np.stack([H_ref[i, :, i, :] for i in range(L)])) <= 1e-10
    off_block = H_ref.copy()
    for i in range(L):
        off_block[i, :, i, :] = 0
    assert np.abs(off_block).max() == 0


def test_hessian_matches_finite_differences(rng):
    L, d = 3, 5
    X, gamma, _ = _inputs(rng, L, d, True)
    J_of = lambda x: blockhess.layernorm_jacobian(x, eps=1e-3, gamma=gamma)  # noqa: E731
    H_fd = ref.finite_difference_jacobian(J_of, X, h=1e-5)
    H = blockhess.layernorm_hessian(X, eps=1e-3, gamma=gamma)
    assert ref.rel_err(H, H_fd) <= 1e-8  # limited by the O(h^2) truncation of central differences


@pytest.mark.parametrize("wrt", ["gamma", "beta"])
def test_affine_parameter_jacobians(rng, wrt):
    L, d = 4, 5
    X, gamma, beta = _inputs(rng, L, d, True)
    if wrt == "gamma":
        J_ref = ref.jacobian(lambda g: ref.layernorm(ref.t(X), 0.0, g, ref.t(beta)), gamma)
    else:
        J_ref = ref.jacobian(lambda b: ref.layernorm(ref.t(X), 0.0, ref.t(gamma), b), beta)
    J = blockhess.layernorm_jacobian(X, gamma=gamma, wrt=wrt)
    assert J.shape == (L * d, d)
    assert ref.rel_err(J, J_ref) <= 1e-12


def test_float32_agrees_with_float64(rng):
    X, gamma, beta = _inputs(rng, 6, 8, True)
    for fn in (
        lambda x, g: blockhess.layernorm(x, 1e-3, g),
        lambda x, g: blockhess.layernorm_jacobian(x, eps=1e-3, gamma=g),
        lambda x, g: blockhess.layernorm_hessian(x, eps=1e-3, gamma=g, layout="blocks"),
    ):
        r32 = fn(X.astype(np.float32), gamma.astype(np.float32))
        r64 = fn(X, gamma)
        assert r32.dtype == np.float32 and r64.dtype == np.float64
        assert ref.rel_err(r32, r64) <= 1e-4


def test_layout_independent_of_memory_order(rng):
    X = rng.standard_normal((5, 7))
    expected = blockhess.layernorm_hessian(X, layout="blocks")
    np.testing.assert_array_equal(blockhess.layernorm_hessian(np.asfortranarray(X), layout="blocks"), expected)
    wide = np.zeros((5, 14))
    wide[:, ::2] = X
    np.testing.assert_array_equal(blockhess.layernorm_hessian(wide[:, ::2], layout="blocks"), expected)


def test_bad_input():
    good = np.arange(12.0).reshape(3, 4) ** 2
    with pytest.raises(ValueError, match="2-D"):
        blockhess.layernorm_jacobian(good.ravel())
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.layernorm_jacobian(good.astype(np.int64))
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.layernorm_jacobian(good.astype(np.complex128))
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.layernorm_jacobian(good.astype(object))
    with pytest.raises(TypeError, match="float16"):
        blockhess.layernorm_jacobian(good.astype(np.float16))
    bad = good.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.layernorm_jacobian(bad)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.layernorm(bad)
    with pytest.raises(ValueError, match=r"gamma must have shape \(4,\)"):
        blockhess.layernorm_jacobian(good, gamma=np.ones(3))
    with pytest.raises(ValueError, match=r"G must have shape \(3, 4\)"):
        blockhess.layernorm_hessian_contract(good, np.ones((4, 3)))
    with pytest.raises(ValueError, match="eps"):
        blockhess.layernorm_jacobian(good, eps=-1.0)
    with pytest.raises(ValueError, match="layout"):
        blockhess.layernorm_jacobian(good, layout="sparse")


def test_zero_variance_row_needs_eps():
    X = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])
    with pytest.raises(ValueError, match=r"row 1 .*zero variance.*eps > 0"):
        blockhess.layernorm_jacobian(X)
    J = blockhess.layernorm_jacobian(X, eps=1e-5, layout="blocks")
    assert np.isfinite(J).all()


def test_dense_request_over_budget_is_refused():
    X = np.random.default_rng(1).standard_normal((64, 32))
    with blockhess.memory_budget(2**20):
        with pytest.raises(MemoryError, match='layout="blocks"'):
            blockhess.layernorm_hessian(X)
        with pytest.raises(ValueError, match=r"needs 32.0 MiB.*budget of 1.00 MiB"):
            blockhess.layernorm_jacobian(X)
        assert blockhess.layernorm_jacobian(X, layout="blocks").shape == (64, 32, 32)
