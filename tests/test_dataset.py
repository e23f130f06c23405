"""dataset_hessian_operator: the Hessian of a data set's mean loss over batches of different sizes,
against the dense Hessian of all samples in one batch (loss_hessian, itself tested against
autograd); the same numbers on a Dask LocalCluster of two workers (loopback, started and closed
here); the running differences ||H^(k+1) - H^(k)||."""

from __future__ import annotations

import numpy as np
import pytest

import blockhess
from blockhess import BlockParams, BlockSpec

EVERYTHING = BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True, activation="gelu",
                       causal=True, eps=1e-5)
L, D, D_K, D_FF = 4, 4, 2, 5


def _data(rng, spec, sizes, loss="mse"):
    params = BlockParams.random(spec, d=D, d_k=D_K, d_ff=D_FF, d_v=2 if spec.out_proj else None, seed=3)
    batches = []
    for n in sizes:
        shape = (L, D) if n is None else (n, L, D)
        X = rng.standard_normal(shape)
        target = rng.standard_normal(shape) if loss == "mse" else rng.integers(0, D, shape[:-1])
        batches.append((X, target))
    # All samples as one batch: its mean loss is the data set's mean loss.
    X_all = np.concatenate([X.reshape(-1, L, D) for X, _ in batches])
    t_all = np.concatenate([t.reshape(-1, L, D) if loss == "mse" else t.reshape(-1, L) for _, t in batches])
    return params, batches, X_all, t_all


@pytest.mark.parametrize("spec", [BlockSpec(), EVERYTHING], ids=["paper", "everything"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_dataset_operator_is_the_hessian_of_the_mean_loss(rng, spec, loss):
    params, batches, X_all, t_all = _data(rng, spec, [None, 2, 3, 1], loss)
    H = blockhess.loss_hessian(X_all, t_all, params, loss=loss)
    op = blockhess.dataset_hessian_operator(batches, params, loss=loss)
    assert op.shape == H.shape and "batches=4, samples=7" in repr(op)
    V = rng.standard_normal((H.shape[0], 3))
    assert np.max(np.abs(op @ V - H @ V)) <= 1e-12 * np.abs(H @ V).max()
    assert np.max(np.abs(op.diagonal() - np.diag(H))) <= 1e-12 * np.abs(np.diag(H)).max()
    assert op.trace() == pytest.approx(np.trace(H), rel=1e-12)
    top = op.eigsh(k=3, return_eigenvectors=False)
    np.testing.assert_allclose(top, np.linalg.eigvalsh(H)[-3:], rtol=0, atol=1e-9 * np.abs(H).max())


def test_running_differences(rng):
    params, batches, _, _ = _data(rng, BlockSpec(), [2, 1, 3, 2])
    op = blockhess.dataset_hessian_operator(batches, params)
    dense = [blockhess.loss_hessian(X, t, params) for X, t in batches]
    counts = np.array([2, 1, 3, 2])
    running = [sum(c * H for c, H in zip(counts[:k], dense[:k])) / counts[:k].sum() for k in range(1, 5)]
    expected_2 = [np.linalg.norm(running[k + 1] - running[k], 2) for k in range(3)]
    expected_f = [np.linalg.norm(running[k + 1] - running[k]) for k in range(3)]
    np.testing.assert_allclose(op.running_differences("frobenius"), expected_f, rtol=1e-10)
    np.testing.assert_allclose(op.running_differences("spectral"), expected_2, rtol=1e-7)


def test_bad_batches_are_named(rng):
    params, batches, _, _ = _data(rng, BlockSpec(), [2])
    with pytest.raises(ValueError, match="at least one"):
        blockhess.dataset_hessian_operator([], params)
    with pytest.raises(ValueError, match=r"\(X, target\) pair"):
        blockhess.dataset_hessian_operator([(batches[0][0],)], params)
    with pytest.raises(TypeError, match="BlockParams"):
        blockhess.dataset_hessian_operator(batches, "params")
    with pytest.raises(ValueError, match=r"\(L, d\) or \(B, L, d\)"):
        blockhess.dataset_hessian_operator([(np.ones(4), np.ones(4))], params)
    op = blockhess.dataset_hessian_operator(batches, params)
    with pytest.raises(ValueError, match="norm must be one of"):
        op.running_differences("nuclear")
    with pytest.raises(ValueError, match="must have"):
        op @ np.ones(3)


# Workers in processes of their own (on loopback), and in this process (threads: what
# benchmarks/benchmarks/bench_dataset.py measures fastest, since the core releases the GIL).
@pytest.fixture(scope="module", params=["processes", "in_process"])
def dask_client(request):
    distributed = pytest.importorskip("distributed", reason="dask[distributed] is in the test extra")
    where = {"processes": True, "host": "127.0.0.1"} if request.param == "processes" else {"processes": False}
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None, silence_logs=40,
                                       **where)
    client = distributed.Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def test_dask_cluster_gives_the_same_numbers(rng, dask_client):
    params, batches, _, _ = _data(rng, EVERYTHING, [2, 1, 3, 2, None, 2])
    local = blockhess.dataset_hessian_operator(batches, params)
    distributed = blockhess.dataset_hessian_operator(batches, params, client=dask_client)
    assert "2 Dask workers" in repr(distributed)
    V = rng.standard_normal((local.shape[0], 2))
    np.testing.assert_allclose(distributed @ V, local @ V, rtol=1e-13, atol=1e-15 * np.abs(local @ V).max())
    np.testing.assert_allclose(distributed.diagonal(), local.diagonal(), rtol=1e-13, atol=1e-16)
    assert distributed.trace(by_block=True).keys() == local.trace(by_block=True).keys()
    np.testing.assert_allclose(distributed.eigsh(k=2, return_eigenvectors=False),
                               local.eigsh(k=2, return_eigenvectors=False), rtol=1e-9)
    # The same vector again and again (a benchmark's repeats): each call sends its own copy.
    v = V[:, 0].copy()
    first = distributed @ v
    for _ in range(5):
        np.testing.assert_array_equal(distributed @ v, first)
