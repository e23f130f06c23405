"""loss_hvp and hessian_operator: the exact matrix-free Hessian-vector product against the dense
loss Hessian (<= 1e-12) and against torch's double-backward HVP (<= 1e-10), in every part, for
both losses, single samples and batches, wrt subsets and eps > 0."""

import numpy as np
import pytest
import reference as ref
import torch

import blockhess
import blockhess._torch_reference as torch_reference

PARTS = ("full", "outer", "functional")
LOSSES = ("mse", "cross_entropy")
SHAPES = [(3, 4, 2, 5), (5, 3, 4, 6), (1, 4, 3, 7), (6, 5, 5, 8)]  # (L, d, d_k, d_ff)


def _problem(rng, L, d, dk, dff, B, loss, dtype=np.float64):
    X, W, _, _ = ref.random_block(rng, L, d, dk, dff, B=B)
    shape = X.shape[:-1]
    target = rng.standard_normal(X.shape) if loss == "mse" else rng.integers(0, d, shape)
    if loss == "mse":
        target = target.astype(dtype)
    return X.astype(dtype), target, blockhess.BlockParams(*(w.astype(dtype) for w in W))


@pytest.mark.parametrize("L,d,dk,dff", SHAPES)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("B", [None, 3])
def test_hvp_equals_dense_hessian_times_v(rng, L, d, dk, dff, loss, part, B):
    X, target, params = _problem(rng, L, d, dk, dff, B, loss)
    H = blockhess.loss_hessian(X, target, params, loss=loss, part=part, eps=1e-3)
    V = rng.standard_normal((params.size, 3))
    HV = blockhess.loss_hvp(X, target, params, V, loss=loss, part=part, eps=1e-3)
    assert HV.shape == V.shape and HV.dtype == np.float64
    assert ref.rel_err(HV, H @ V) <= 1e-12
    Hv = blockhess.loss_hvp(X, target, params, V[:, 0], loss=loss, part=part, eps=1e-3)
    assert Hv.shape == (params.size,)
    assert ref.rel_err(Hv, H @ V[:, 0]) <= 1e-12


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("B", [None, 3])
def test_hvp_matches_torch_double_backward(rng, loss, part, B):
    X, target, params = _problem(rng, 5, 4, 3, 6, B, loss)
    v = rng.standard_normal(params.size)
    ours = blockhess.loss_hvp(X, target, params, v, loss=loss, part=part)
    theirs = torch_reference.loss_hvp(X, target, params.arrays, v, kind=loss, part=part).numpy()
    assert ref.rel_err(ours, theirs) <= 1e-10


@pytest.mark.parametrize("wrt", [("W_Q",), ("W_K", "W_1"), ("W_V", "W_2"), ("W_2", "W_Q")])
@pytest.mark.parametrize("part", PARTS)
def test_hvp_over_a_subset_of_parameters(rng, wrt, part):
    X, target, params = _problem(rng, 4, 3, 2, 5, 2, "mse")
    H = blockhess.loss_hessian(X, target, params, part=part, wrt=wrt)
    v = rng.standard_normal(H.shape[0])
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, v, part=part, wrt=wrt), H @ v) <= 1e-12
    theirs = torch_reference.loss_hvp(X, target, params.arrays, v, part=part, wrt=wrt).numpy()
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, v, part=part, wrt=wrt), theirs) <= 1e-10


def test_outer_plus_functional_is_full(rng):
    X, target, params = _problem(rng, 5, 4, 3, 6, 2, "cross_entropy")
    V = rng.standard_normal((params.size, 2))
    parts = {p: blockhess.loss_hvp(X, target, params, V, loss="cross_entropy", part=p) for p in PARTS}
    assert ref.rel_err(parts["outer"] + parts["functional"], parts["full"]) <= 1e-13


def test_float32_is_close_to_float64(rng):
    X, target, params = _problem(rng, 6, 5, 4, 7, 2, "mse")
    v = rng.standard_normal(params.size)
    exact = blockhess.loss_hvp(X, target, params, v)
    X32, t32 = X.astype(np.float32), target.astype(np.float32)
    p32 = blockhess.BlockParams(*(w.astype(np.float32) for w in params.arrays))
    single = blockhess.loss_hvp(X32, t32, p32, v.astype(np.float32))
    assert single.dtype == np.float32
    assert ref.rel_err(single, exact) <= 1e-4
    # Every array takes part in the dtype promotion: a float64 vector gives a float64 product.
    assert blockhess.loss_hvp(X32, t32, p32, v).dtype == np.float64


def test_operator_products_and_caching(rng):
    X, target, params = _problem(rng, 5, 4, 3, 6, 2, "mse")
    op = blockhess.hessian_operator(X, target, params, part="full", wrt=("W_Q", "W_V", "W_2"))
    H = blockhess.loss_hessian(X, target, params, wrt=("W_Q", "W_V", "W_2"))
    assert op.shape == H.shape and op.dtype == np.float64
    assert op.names == ("W_Q", "W_V", "W_2")
    assert "HessianOperator" in repr(op)
    assert op.loss_value == pytest.approx(blockhess.loss_value(X, target, params), rel=1e-14)
    V = rng.standard_normal((op.shape[0], 4))
    HV = op.matmat(V)
    assert ref.rel_err(HV, H @ V) <= 1e-12
    # Columns are independent products, each computed as a single one: the same bits.
    for j in range(V.shape[1]):
        assert np.array_equal(HV[:, j], op.matvec(V[:, j]))
        assert np.array_equal(op @ V[:, j], HV[:, j])
    assert np.array_equal(op @ V, HV)
    # Not C-contiguous input: same bits.
    assert np.array_equal(op.matmat(np.asfortranarray(V)), HV)


def test_loss_hvp_is_one_operator_product_bit_for_bit(rng):
    """loss_hvp reads the weights in place (one call); the operator keeps a copy: the same bits."""
    spec = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                               activation="gelu_tanh", causal=True)
    params = blockhess.BlockParams.random(spec, d=6, d_k=2, d_ff=10, seed=3)
    X, target = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 6))
    V = rng.standard_normal((params.size, 3))
    op = blockhess.hessian_operator(X, target, params)
    assert np.array_equal(blockhess.loss_hvp(X, target, params, V), op.matmat(V))
    assert np.array_equal(blockhess.loss_hvp(X, target, params, V[:, 1]), op.matvec(V[:, 1]))


def test_operator_keeps_its_own_copy_of_the_weights(rng):
    """The operator outlives the call: changing (or dropping) the caller's arrays afterwards does not
    change its products."""
    X, target, params = _problem(rng, 5, 4, 3, 6, None, "mse")
    weights = [np.array(w) for w in params.arrays]
    op = blockhess.hessian_operator(X, target, blockhess.BlockParams(*weights))
    v = rng.standard_normal(op.shape[0])
    before = op.matvec(v)
    for w in weights:
        w[...] = 0.0
    del weights
    assert np.array_equal(op.matvec(v), before)


def _products_on_threads(op, V, counts):
    """op @ V with the core on each of ``counts`` threads, the caller's setting restored."""
    before = blockhess.get_num_threads()
    try:
        results = []
        for threads in counts:
            blockhess.set_num_threads(threads)
            results.append(op @ V)
        return results
    finally:
        blockhess.set_num_threads(before)


def test_operator_bits_do_not_depend_on_threads(rng):
    X, target, params = _problem(rng, 8, 6, 4, 10, 3, "cross_entropy")
    op = blockhess.hessian_operator(X, target, params, loss="cross_entropy")
    V = rng.standard_normal((op.shape[0], 5))
    one, four = _products_on_threads(op, V, (1, 4))
    assert np.array_equal(one, four)


# Deep products into small results (a weight's gradient over 1,568 tokens into 16 x 64) are summed
# in chunks of depth (parallel_product.hpp): they still match torch, in both precisions, and do
# not depend on the thread count.
def test_hvp_over_many_tokens(rng):
    X, target, params = _problem(rng, 49, 16, 16, 64, 32, "mse")
    v = rng.standard_normal(params.size)
    theirs = torch_reference.loss_hvp(X, target, params.arrays, v, kind="mse", part="full").numpy()
    assert ref.rel_err(blockhess.loss_hvp(X, target, params, v), theirs) <= 1e-10
    single = blockhess.BlockParams(*(w.astype(np.float32) for w in params.arrays))
    ours32 = blockhess.loss_hvp(X.astype(np.float32), target.astype(np.float32), single, v.astype(np.float32))
    assert ours32.dtype == np.float32 and ref.rel_err(ours32, theirs) <= 1e-4
    one, three = _products_on_threads(blockhess.hessian_operator(X, target, params), v, (1, 3))
    assert np.array_equal(one, three)


def test_operator_through_scipy_eigsh(rng):
    scipy_linalg = pytest.importorskip("scipy.sparse.linalg")
    X, target, params = _problem(rng, 5, 4, 3, 6, 2, "mse")
    op = blockhess.hessian_operator(X, target, params)
    H = blockhess.loss_hessian(X, target, params)
    exact = np.linalg.eigvalsh(H)
    top = scipy_linalg.eigsh(op.to_scipy(), k=3, which="LA", return_eigenvectors=False, tol=1e-12)
    assert np.allclose(np.sort(top), exact[-3:], rtol=1e-8, atol=1e-12 * abs(exact).max())


def test_torch_tensors_in_and_out(rng):
    X, target, params = _problem(rng, 4, 3, 2, 5, None, "mse")
    v = rng.standard_normal(params.size)
    expected = blockhess.loss_hvp(X, target, params, v)
    got = blockhess.loss_hvp(torch.from_numpy(X), torch.from_numpy(target), params, torch.from_numpy(v))
    assert isinstance(got, torch.Tensor)
    assert np.array_equal(got.numpy(), expected)
    op = blockhess.hessian_operator(X, target, params)
    assert isinstance(op.matvec(torch.from_numpy(v)), torch.Tensor)
    assert isinstance(op.matvec(v), np.ndarray)


def test_bad_vectors_are_clear_errors(rng):
    X, target, params = _problem(rng, 4, 3, 2, 5, None, "mse")
    op = blockhess.hessian_operator(X, target, params, wrt=("W_1",))
    with pytest.raises(ValueError, match=r"15 rows .*W_1"):
        op.matvec(np.ones(params.size))
    with pytest.raises(TypeError, match="int64"):
        op.matvec(np.ones(15, dtype=np.int64))
    with pytest.raises(ValueError, match="V"):
        blockhess.loss_hvp(X, target, params, np.ones((params.size, 2, 2)))
    with pytest.raises(ValueError, match="finite|NaN"):
        blockhess.loss_hvp(X, target, params, np.full(params.size, np.nan))
    with pytest.raises(ValueError, match="part"):
        blockhess.hessian_operator(X, target, params, part="diagonal")
    with pytest.raises(ValueError, match="W_O"):
        blockhess.hessian_operator(X, target, params, wrt=("W_O",))


def test_overflowing_product_names_its_stage(rng):
    X, target, params = _problem(rng, 4, 3, 2, 5, None, "mse")
    op = blockhess.hessian_operator(X, target, params)
    with pytest.raises(blockhess.NonFiniteError, match="Hessian-vector product"):
        op.matvec(np.full(params.size, 1.7e308))


def test_memory_budget_covers_the_operator(rng):
    X, target, params = _problem(rng, 4, 3, 2, 5, None, "mse")
    with blockhess.memory_budget(1024):
        with pytest.raises(blockhess.OutputTooLargeError, match="Hessian-vector"):
            blockhess.loss_hvp(X, target, params, np.ones(params.size))
