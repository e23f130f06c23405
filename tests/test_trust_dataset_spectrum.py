"""Issue 25 for the data set's operator and blockhess.spectrum: the operator answers for the data as
they were at construction, in the common dtype, from (X, target) pairs only; a Dask client is
checked; SLQ does not depend on the operator's scale (the zero operator included); every argument
and allocation of spectral_density and eigsh is checked first; eigsh is exact at small sizes and
never lets scipy's ARPACK errors escape."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import blockhess
from blockhess import BlockParams, spectrum

L, D, D_K, D_FF = 3, 4, 2, 3


def _params(dtype=np.float64):
    return BlockParams.random(d=D, d_k=D_K, d_ff=D_FF, seed=1, dtype=dtype)


def _batches(rng, sizes, dtype=np.float64):
    return [(rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype))
            for shape in ((L, D) if n is None else (n, L, D) for n in sizes)]


def _copies(batches):
    return [(X.copy(), t.copy()) for X, t in batches]


class _Dense:
    """A symmetric matrix as the operator eigsh takes (shape and to_scipy), with its products counted."""

    def __init__(self, A):
        self.A, self.shape, self.products = A, A.shape, 0

    def to_scipy(self):
        from scipy.sparse.linalg import LinearOperator

        def product(V):
            self.products += 1
            return self.A @ V

        return LinearOperator(self.shape, matvec=product, matmat=product, rmatvec=product, dtype=np.float64)


def _symmetric(rng, P):
    A = rng.standard_normal((P, P))
    return A + A.T


def _answers(op):
    """Everything the operator answers (each deterministic: the same inputs give the same bits)."""
    v = np.random.default_rng(5).standard_normal((op.shape[0], 2))
    sd = op.spectral_density(probes=2, steps=4, grid=20)
    return {"matvec": op @ v[:, 0], "matmat": op @ v, "diagonal": op.diagonal(), "trace": op.trace(),
            "by_block": np.array(list(op.trace(by_block=True).values())), "frobenius_norm": op.frobenius_norm(),
            "eigsh": op.eigsh(k=2, return_eigenvectors=False), "density": sd.density,
            "frobenius differences": op.running_differences("frobenius"),
            "spectral differences": op.running_differences("spectral")}


_MUTATIONS = st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["X", "target", "weights"]),
                                st.sampled_from(["scale", "fill", "entry", "negate"])), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.sampled_from([None, 1, 2]), min_size=2, max_size=3), mutations=_MUTATIONS)
def test_every_method_answers_for_the_data_at_construction(sizes, mutations):
    rng = np.random.default_rng(len(sizes))
    batches = _batches(rng, sizes)
    spec_params = _params()
    weights = {n: w.copy() for n, w in zip(spec_params.names, spec_params.arrays)}
    params = BlockParams.from_arrays(spec_params.spec, weights)
    fresh = blockhess.dataset_hessian_operator(_copies(batches), _params())
    op = blockhess.dataset_hessian_operator(batches, params)
    for which, what, how in mutations:  # the caller reuses its arrays in place
        X, target = batches[which % len(batches)]
        a = {"X": X, "target": target, "weights": list(weights.values())[which]}[what]
        if how == "scale":
            a *= 2.5
        elif how == "fill":
            a.fill(0.25)
        elif how == "entry":
            a.reshape(-1)[0] += 1.0
        else:
            np.negative(a, out=a)
    expected = _answers(fresh)
    for name, answer in _answers(op).items():
        np.testing.assert_array_equal(answer, expected[name], err_msg=name)


@pytest.mark.parametrize("first", [np.float32, np.float64])
def test_the_dtype_is_common_to_every_batch(rng, first):
    second = np.float64 if first == np.float32 else np.float32
    batches = _batches(rng, [2]) + _batches(rng, [1])
    mixed = [(X.astype(first), t.astype(first)) for X, t in batches[:1]] + \
            [(X.astype(second), t.astype(second)) for X, t in batches[1:]]
    p32 = _params(np.float32)
    op = blockhess.dataset_hessian_operator(mixed, p32)
    # Every batch computes in float64, as if every array had been float64 (float32 values are exact there).
    p64 = BlockParams.from_arrays(p32.spec, {n: w.astype(np.float64) for n, w in zip(p32.names, p32.arrays)})
    promoted = blockhess.dataset_hessian_operator([(X.astype(np.float64), t.astype(np.float64)) for X, t in mixed],
                                                  p64)
    assert op.dtype == np.float64
    v = rng.standard_normal(op.shape[0])
    np.testing.assert_array_equal(op @ v, promoted @ v)
    np.testing.assert_array_equal(op.diagonal(), promoted.diagonal())
    all32 = blockhess.dataset_hessian_operator([(X.astype(np.float32), t.astype(np.float32)) for X, t in batches],
                                               p32)
    assert all32.dtype == np.float32 and (all32 @ v).dtype == np.float32


def test_a_batch_must_be_an_x_target_pair(rng):
    (X, t), = _batches(rng, [2])
    params = _params()
    with pytest.raises(TypeError, match=r"batch 0 must be an \(X, target\) pair"):
        blockhess.dataset_hessian_operator([np.stack([X[0], t[0]])], params)  # a bare (2, L, d) array
    with pytest.raises(TypeError, match=r"batch 1 must be an \(X, target\) pair"):
        blockhess.dataset_hessian_operator([(X, t), X], params)
    with pytest.raises(ValueError, match=r"batch 1 must be an \(X, target\) pair, got 3 items"):
        blockhess.dataset_hessian_operator([(X, t), (X, t, t)], params)
    with pytest.raises(TypeError, match="batches must be an iterable"):
        blockhess.dataset_hessian_operator(3, params)
    with pytest.raises(TypeError, match="X of batch 1 must have dtype"):
        blockhess.dataset_hessian_operator([(X, t), (X.astype(int), t)], params)


def test_x_and_target_as_lists_or_tuples(rng):
    batches = _batches(rng, [2, None])
    params = _params()
    reference = blockhess.dataset_hessian_operator(batches, params)
    as_lists = [(X.tolist(), tuple(t.tolist())) for X, t in batches]
    op = blockhess.dataset_hessian_operator(as_lists, params)
    v = rng.standard_normal(op.shape[0])
    np.testing.assert_array_equal(op @ v, reference @ v)
    np.testing.assert_array_equal(op.diagonal(), reference.diagonal())
    classes = [(X.tolist(), [[0, 1, 2]] * 2) for X, _ in batches[:1]]
    assert blockhess.dataset_hessian_operator(classes, params, loss="cross_entropy").trace() == pytest.approx(
        blockhess.hessian_operator(batches[0][0], np.array([[0, 1, 2]] * 2), params, loss="cross_entropy").trace(),
        rel=1e-14)


def test_the_client_must_be_a_running_dask_client(rng):
    distributed = pytest.importorskip("distributed", reason="dask[distributed] is in the test extra")
    batches, params = _batches(rng, [1]), _params()
    for client in ("tcp://127.0.0.1:8786", object()):
        with pytest.raises(TypeError, match="client must be a dask.distributed.Client"):
            blockhess.dataset_hessian_operator(batches, params, client=client)
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None,
                                       silence_logs=40)
    client = distributed.Client(cluster)
    client.close()
    cluster.close()
    with pytest.raises(ValueError, match="the Dask client is not running"):
        blockhess.dataset_hessian_operator(batches, params, client=client)


def test_slq_does_not_depend_on_the_operator_scale(rng):
    A = _symmetric(rng, 30)
    for steps in (8, 60):  # 60 > P: every probe stops on the whole space, its nodes A's eigenvalues
        unit = spectrum.spectral_density(lambda v: A @ v, 30, probes=3, steps=steps)
        tiny = spectrum.spectral_density(lambda v: (1e-20 * A) @ v, 30, probes=3, steps=steps)
        assert [len(t) for t in tiny.nodes] == [len(t) for t in unit.nodes]
        for m in range(1, 5):
            assert tiny.moment(m) / 1e-20**m == pytest.approx(unit.moment(m), rel=1e-10)
        assert tiny.sigma == pytest.approx(1e-20 * unit.sigma, rel=1e-10)
    np.testing.assert_allclose(tiny.nodes[0], 1e-20 * np.linalg.eigvalsh(A), rtol=0, atol=1e-30 * np.abs(A).max())


def test_the_zero_operator_has_a_proper_density():
    sd = spectrum.spectral_density(lambda v: np.zeros_like(v), 20, probes=3, steps=5)
    assert all(np.array_equal(t, [0.0]) for t in sd.nodes)
    assert np.isfinite(sd.density).all() and sd.sigma > 0
    assert np.trapezoid(sd.density, sd.grid) == pytest.approx(1.0, abs=1e-6)
    assert sd.truncation < 1e-6 and sd.grid[np.argmax(sd.density)] == pytest.approx(0.0, abs=sd.sigma)


def test_spectral_density_checks_its_arguments():
    A = np.diag(np.arange(1.0, 6.0))
    products = []

    def matvec(v):
        products.append(1)
        return A @ v

    for grid, error in ((True, TypeError), (2.5, TypeError), (1, ValueError), ([0.0, 1.0, 1.0], ValueError),
                        ([0.0, np.nan], ValueError), (np.zeros((2, 2)), ValueError), ([0, 1], TypeError)):
        with pytest.raises(error, match="grid"):
            spectrum.spectral_density(matvec, 5, grid=grid)
    for sigma, error in ((True, TypeError), ("1", TypeError), (0.0, ValueError), (1e-320, ValueError),
                         (float("inf"), ValueError)):
        with pytest.raises(error, match="sigma"):
            spectrum.spectral_density(matvec, 5, sigma=sigma)
    with pytest.raises(TypeError, match="P must be an integer"):
        spectrum.spectral_density(matvec, 5.0)
    assert not products  # refused before the first product
    sd = spectrum.spectral_density(matvec, 5, sigma=np.float32(0.5), grid=np.int64(7), probes=np.int32(1))
    assert sd.sigma == 0.5 and sd.grid.shape == (7,)
    grid = np.linspace(0.0, 6.0, 50, dtype=np.float32)
    assert spectrum.spectral_density(matvec, 5, grid=grid).grid.dtype == np.float64


def test_spectral_density_allocates_within_the_budget():
    def matvec(v):
        raise AssertionError("a product before the memory check")

    with blockhess.memory_budget("1MiB"):
        with pytest.raises(blockhess.OutputTooLargeError, match="spectral density on a grid of 1000000 points"):
            spectrum.spectral_density(matvec, 5, steps=3, grid=10**6)
        with pytest.raises(blockhess.OutputTooLargeError, match="P = 100000"):
            spectrum.spectral_density(matvec, 100_000, steps=60)  # the Lanczos basis: 60 x P
        with pytest.raises(blockhess.OutputTooLargeError, match="Lanczos basis"):
            spectrum.lanczos(matvec, np.ones(100_000), 60)


def test_eigsh_checks_its_arguments(rng):
    op = _Dense(_symmetric(rng, 8))
    for k, error in ((2.0, TypeError), (True, TypeError), (0, ValueError), (8, ValueError)):
        with pytest.raises(error, match="k must"):
            spectrum.eigsh(op, k, "LA", 0.0, False)
    for tol, error in ((True, TypeError), ("0", TypeError), (-1.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="tol must"):
            spectrum.eigsh(op, 2, "LA", tol, False)
    with pytest.raises(ValueError, match="which must be one of"):
        spectrum.eigsh(op, 2, "BE", 0.0, False)
    for flag in ("yes", 1, None):
        with pytest.raises(TypeError, match="return_eigenvectors must be True or False"):
            spectrum.eigsh(op, 2, "LA", 0.0, flag)
    assert op.products == 0
    values = spectrum.eigsh(op, np.int64(2), "LA", np.float32(1e-6), np.bool_(False))
    np.testing.assert_allclose(values, np.linalg.eigvalsh(op.A)[-2:], rtol=1e-12)


def test_eigsh_allocates_within_the_budget():
    class _Huge:
        shape = (10**6, 10**6)

        def to_scipy(self):
            raise AssertionError("a product before the memory check")

    with blockhess.memory_budget("64MiB"):
        with pytest.raises(blockhess.OutputTooLargeError, match="eigsh"):
            spectrum.eigsh(_Huge(), 6, "LA", 0.0, False)  # ARPACK's basis: 20 x P


@pytest.mark.parametrize("P", [2, 6, 40, 130])
def test_eigsh_is_exact_at_small_sizes_and_large_k(rng, P):
    A = _symmetric(rng, P)
    exact = np.linalg.eigvalsh(A)
    k = P - 1
    for which, expected in (("LA", exact[1:]), ("SA", exact[:-1]),
                            ("LM", np.sort(exact[np.argsort(np.abs(exact))[1:]]))):
        values, vectors = spectrum.eigsh(_Dense(A), k, which, 0.0, True)
        np.testing.assert_allclose(values, expected, rtol=0, atol=1e-12 * np.abs(exact).max())
        np.testing.assert_allclose(A @ vectors, vectors * values, rtol=0, atol=1e-11 * np.abs(exact).max())
    # Small operators, and large k, are diagonalised densely (P products with the identity, in one
    # matmat here); else ARPACK's products.
    for k in (1, P // 2):
        op = _Dense(A)
        spectrum.eigsh(op, max(k, 1), "LA", 0.0, False)
        assert (op.products == 1) == (P <= 100 or 2 * k + 1 >= P)


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eigsh_at_tiny_sizes(dtype, d):
    """P = d: ARPACK stopped ("starting vector is zero") on the float32 operator at d = 2, where the
    post-LN block of two features is flat (its loss Hessian vanishes up to rounding, and its
    product with ARPACK's start is 0 for these data)."""
    rng = np.random.default_rng(2)
    params = BlockParams.random(d=d, d_k=1, d_ff=1, seed=1, dtype=dtype)
    X, target = rng.standard_normal((2, 3, d)).astype(dtype), rng.standard_normal((2, 3, d)).astype(dtype)
    op = blockhess.hessian_operator(X, target, params, wrt=("W_Q",))
    exact = np.linalg.eigvalsh(blockhess.loss_hessian(X, target, params, wrt=("W_Q",)).astype(np.float64))
    atol = (1e-5 if dtype == np.float32 else 1e-12) * max(np.abs(exact).max(), 1e-6)
    for k in range(1, d):
        for which, expected in (("LA", exact[d - k:]), ("SA", exact[:k]),
                                ("LM", np.sort(exact[np.argsort(np.abs(exact))[d - k:]]))):
            values, vectors = op.eigsh(k=k, which=which)
            np.testing.assert_allclose(values, expected, rtol=0, atol=atol)
            assert vectors.shape == (d, k)


def test_eigsh_of_the_zero_operator_is_zero():
    P = 150  # past the dense size: ARPACK, which stops on its start vector (H v0 = 0)
    for vectors in (False, True):
        result = spectrum.eigsh(_Dense(np.zeros((P, P))), 3, "LM", 0.0, vectors)
        values = result[0] if vectors else result
        np.testing.assert_array_equal(values, np.zeros(3))
        if vectors:
            np.testing.assert_array_equal(result[1].T @ result[1], np.eye(3))


def test_running_differences_of_identical_batches_are_zero(rng):
    batches = _batches(rng, [2]) * 3
    op = blockhess.dataset_hessian_operator(batches, _params())
    scale = np.abs(op.diagonal()).max()
    np.testing.assert_allclose(op.running_differences("spectral"), [0.0, 0.0], rtol=0, atol=1e-14 * scale)
    np.testing.assert_allclose(op.running_differences("frobenius"), [0.0, 0.0], rtol=0, atol=1e-14 * scale)


def test_arpack_failures_are_blockhess_errors(rng, monkeypatch):
    import scipy.sparse.linalg as linalg

    A = _symmetric(rng, 150)

    def no_convergence(*args, **kwargs):
        raise linalg.ArpackNoConvergence("ARPACK error -1: No convergence", np.ones(1), np.ones((150, 1)))

    def failure(*args, **kwargs):
        raise linalg.ArpackError(-9999)

    monkeypatch.setattr(linalg, "eigsh", no_convergence)
    with pytest.raises(ValueError, match=r"eigsh did not converge: ARPACK found 1 of the k=3 eigenvalues"):
        spectrum.eigsh(_Dense(A), 3, "LA", 0.0, False)
    monkeypatch.setattr(linalg, "eigsh", failure)
    with pytest.raises(ValueError, match="ARPACK could not compute the k=3 eigenvalues") as info:
        spectrum.eigsh(_Dense(A), 3, "LA", 0.0, False)
    assert not isinstance(info.value, linalg.ArpackError)
