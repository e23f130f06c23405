"""The Transformer block: forward, Jacobians, output second derivatives, loss gradient and loss
Hessian (full / outer / functional) against PyTorch autograd in float64 and finite differences."""

import numpy as np
import pytest
import reference as ref
from torch.func import hessian, jacrev

import blockhess

NAMES = ref.PARAM_NAMES
# (L, d, d_k, d_ff): L != d, d_k != d, d_ff != d, L = 1, d = 2 among them
SHAPES = [(3, 4, 2, 5), (5, 3, 4, 6), (1, 4, 3, 7), (4, 2, 3, 3), (6, 5, 5, 8)]


def _params(weights):
    return blockhess.BlockParams(*weights)


def _torch_block(X, weights, eps):
    return ref.transformer_block(ref.t(X), *map(ref.t, weights), eps=eps).numpy()


@pytest.mark.parametrize("L,d,dk,dff", SHAPES)
def test_forward_single_and_batch(rng, L, d, dk, dff):
    X, W, _, _ = ref.random_block(rng, L, d, dk, dff, B=3)
    Z = blockhess.block_forward(X, _params(W), eps=1e-3)
    assert Z.shape == X.shape
    assert ref.rel_err(Z, _torch_block(X, W, 1e-3)) <= 1e-12
    assert ref.rel_err(blockhess.block_forward(X[1], _params(W), eps=1e-3), Z[1]) <= 1e-14


@pytest.mark.parametrize("L,d,dk,dff", SHAPES)
@pytest.mark.parametrize("wrt", NAMES)
def test_jacobian_matches_autograd(rng, L, d, dk, dff, wrt):
    X, W, _, _ = ref.random_block(rng, L, d, dk, dff)
    p = NAMES.index(wrt)

    def Z_of(w):
        ws = [ref.t(a) for a in W]
        ws[p] = w
        return ref.transformer_block(ref.t(X), *ws, eps=1e-4)

    J = blockhess.block_jacobian(X, _params(W), wrt, eps=1e-4)
    assert J.shape == (L * d, W[p].size)
    scale = 1.0 if d == 2 else 1e-300  # LayerNorm over d = 2 features is constant: J = 0
    assert ref.rel_err(J, ref.jacobian(Z_of, W[p]), scale) <= 1e-10


@pytest.mark.parametrize("L,d,dk,dff", [(3, 4, 2, 5), (2, 3, 4, 2)])
def test_every_output_hessian_pair_matches_autograd(rng, L, d, dk, dff):
    X, W, _, _ = ref.random_block(rng, L, d, dk, dff)
    params = _params(W)
    for i, a in enumerate(NAMES):
        for j, b in enumerate(NAMES):
            def Z_of(wi, wj):
                ws = [ref.t(w) for w in W]
                ws[i] = wi
                if j != i:
                    ws[j] = wj
                return ref.transformer_block(ref.t(X), *ws, eps=1e-3)

            if i == j:
                H_ref = hessian(lambda w: Z_of(w, None))(ref.t(W[i]))
            else:
                H_ref = jacrev(jacrev(Z_of, argnums=0), argnums=1)(ref.t(W[i]), ref.t(W[j]))
            H_ref = H_ref.reshape(L * d * W[i].size, W[j].size).numpy()
            H = blockhess.block_output_hessian(X, params, a, b, eps=1e-3)
            assert H.shape == H_ref.shape
            assert ref.rel_err(H, H_ref, 1e-6) <= 1e-10, (a, b)


CASES = [  # (L, d, d_k, d_ff, batch, loss, eps)
    (3, 4, 2, 5, None, "mse", 0.0),
    (5, 3, 4, 6, None, "mse", 1e-3),
    (4, 5, 3, 7, 3, "mse", 1e-5),
    (1, 4, 3, 5, 2, "mse", 0.0),
    (3, 4, 2, 5, None, "cross_entropy", 0.0),
    (4, 3, 5, 6, 2, "cross_entropy", 1e-3),
    (6, 5, 5, 8, None, "cross_entropy", 1e-5),
]


@pytest.mark.parametrize("L,d,dk,dff,B,loss,eps", CASES)
def test_loss_hessian_full_outer_functional_match_autograd(rng, L, d, dk, dff, B, loss, eps):
    X, W, target, classes = ref.random_block(rng, L, d, dk, dff, B=B)
    tgt = target if loss == "mse" else classes
    params = _params(W)
    grad_ref, full_ref, outer_ref = ref.block_loss_derivatives(X, W, tgt, loss, eps)
    functional_ref = full_ref - outer_ref

    assert ref.rel_err(blockhess.loss_gradient(X, tgt, params, loss=loss, eps=eps), grad_ref) <= 1e-10
    full = blockhess.loss_hessian(X, tgt, params, loss=loss, eps=eps)
    outer = blockhess.loss_hessian(X, tgt, params, loss=loss, eps=eps, part="outer")
    functional = blockhess.loss_hessian(X, tgt, params, loss=loss, eps=eps, part="functional")
    assert full.shape == (params.size, params.size)
    assert ref.rel_err(full, full_ref) <= 1e-10
    assert ref.rel_err(outer, outer_ref) <= 1e-10
    assert ref.rel_err(functional, functional_ref) <= 1e-10
    for H in (full, outer, functional):
        np.testing.assert_array_equal(H, H.T)  # symmetric bit for bit
    assert ref.rel_err(outer + functional, full) <= 1e-13
    # every block separately, so a small wrong block cannot hide behind a large right one; blocks
    # that vanish in theory (e.g. attention with L = 1) are measured against 1e-4 ||H||
    s = params.slices()
    floor = 1e-4 * np.linalg.norm(full_ref)
    for a in NAMES:
        for b in NAMES:
            assert ref.rel_err(full[s[a], s[b]], full_ref[s[a], s[b]], floor) <= 1e-10, (a, b)


def test_loss_hessian_matches_finite_differences_of_the_gradient(rng):
    L, d, dk, dff = 4, 5, 3, 6
    X, W, target, _ = ref.random_block(rng, L, d, dk, dff)
    params = _params(W)
    v0 = params.flatten()

    def grad(v):
        return blockhess.loss_gradient(X, target, blockhess.BlockParams.unflatten(v, params), eps=1e-3)

    H_fd = ref.finite_difference_jacobian(grad, v0, h=1e-5)
    H = blockhess.loss_hessian(X, target, params, eps=1e-3)
    assert ref.rel_err(H, H_fd) <= 1e-7  # O(h^2) truncation of central differences


def test_blocks_layout_and_parameter_subsets(rng):
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5, B=2)
    params = _params(W)
    dense = blockhess.loss_hessian(X, target, params)
    blocks = blockhess.loss_hessian(X, target, params, layout="blocks")
    s = params.slices()
    assert set(blocks) == {(a, b) for a in NAMES for b in NAMES}
    for (a, b), block in blocks.items():
        assert block.shape == (params.sizes[NAMES.index(a)], params.sizes[NAMES.index(b)])
        np.testing.assert_allclose(block, dense[s[a], s[b]], rtol=1e-13, atol=1e-15)
    sub = blockhess.loss_hessian(X, target, params, wrt=("W_V", "W_Q"))
    rows = np.r_[s["W_Q"], s["W_V"]]
    np.testing.assert_allclose(sub, dense[np.ix_(rows, rows)], rtol=1e-12, atol=1e-15)
    sub_blocks = blockhess.loss_hessian(X, target, params, wrt=("W_2",), layout="blocks")
    assert list(sub_blocks) == [("W_2", "W_2")]


def test_block_params_round_trip(rng):
    _, W, _, _ = ref.random_block(rng, 3, 4, 2, 5)
    params = _params(W)
    assert params.names == NAMES
    assert params.sizes == tuple(w.size for w in W)
    v = params.flatten()
    assert v.shape == (sum(params.sizes),)
    back = blockhess.BlockParams.unflatten(v, params)
    for a, b in zip(back, W):
        np.testing.assert_array_equal(a, b)


def test_float32_agrees_with_float64(rng):
    X, W, target, classes = ref.random_block(rng, 5, 4, 3, 6)
    p64, p32 = _params(W), _params([w.astype(np.float32) for w in W])
    for loss, tgt in (("mse", target), ("cross_entropy", classes)):
        tgt32 = tgt.astype(np.float32) if loss == "mse" else tgt
        H64 = blockhess.loss_hessian(X, tgt, p64, loss=loss, eps=1e-3)
        H32 = blockhess.loss_hessian(X.astype(np.float32), tgt32, p32, loss=loss, eps=1e-3)
        assert H32.dtype == np.float32 and H64.dtype == np.float64
        assert ref.rel_err(H32, H64) <= 1e-4
        np.testing.assert_array_equal(H32, H32.T)
    Z32 = blockhess.block_forward(X.astype(np.float32), p32)
    assert Z32.dtype == np.float32
    assert ref.rel_err(Z32, blockhess.block_forward(X, p64)) <= 1e-5


def test_memory_order_does_not_matter(rng):
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5)
    expected = blockhess.loss_hessian(X, target, _params(W))
    fortran = blockhess.loss_hessian(np.asfortranarray(X), np.asfortranarray(target),
                                     _params([np.asfortranarray(w) for w in W]))
    np.testing.assert_array_equal(fortran, expected)
    strided = np.zeros((4, 6))
    strided[:, ::2] = X
    np.testing.assert_array_equal(blockhess.loss_hessian(strided[:, ::2], target, _params(W)), expected)


def test_bad_input(rng):
    X, W, target, classes = ref.random_block(rng, 4, 3, 2, 5)
    params = _params(W)
    with pytest.raises(ValueError, match=r"W_V must have shape \(3, 3\)"):
        blockhess.BlockParams(W[0], W[1], np.ones((3, 4)), W[3], W[4])
    with pytest.raises(ValueError, match=r"W_2 must have shape \(5, 3\)"):
        blockhess.BlockParams(W[0], W[1], W[2], W[3], np.ones((4, 3)))
    with pytest.raises(TypeError, match="BlockParams"):
        blockhess.loss_hessian(X, target, W)
    with pytest.raises(ValueError, match="features"):
        blockhess.block_forward(np.ones((4, 5)), params)
    with pytest.raises(ValueError, match="shape of X"):
        blockhess.loss_hessian(X, target[:3], params)
    with pytest.raises(ValueError, match="shape of X"):
        blockhess.loss_hessian(np.stack([X, X]), target, params)
    with pytest.raises(TypeError, match="integer class"):
        blockhess.loss_hessian(X, target, params, loss="cross_entropy")
    with pytest.raises(ValueError, match="out of range"):
        blockhess.loss_hessian(X, np.full(4, 3), params, loss="cross_entropy")
    with pytest.raises(ValueError, match="out of range"):
        blockhess.loss_gradient(X, np.full(4, -1), params, loss="cross_entropy")
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        blockhess.loss_hessian(np.stack([X, X]), classes, params, loss="cross_entropy")
    with pytest.raises(ValueError, match="loss"):
        blockhess.loss_hessian(X, target, params, loss="hinge")
    with pytest.raises(ValueError, match="part"):
        blockhess.loss_hessian(X, target, params, part="gauss")
    with pytest.raises(ValueError, match="wrt"):
        blockhess.loss_hessian(X, target, params, wrt=("W_Q", "W_Q"))
    with pytest.raises(ValueError, match="parameter name"):
        blockhess.block_jacobian(X, params, "W_O")
    with pytest.raises(TypeError, match="float32 or float64"):
        blockhess.block_forward(X.astype(np.int32), params)
    bad = X.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.loss_hessian(bad, target, params)
    with pytest.raises(ValueError, match="2-D"):
        blockhess.block_jacobian(np.stack([X, X]), params, "W_Q")


def test_zero_variance_needs_eps(rng):
    _, W, _, _ = ref.random_block(rng, 3, 4, 2, 5)
    W[2] = np.zeros_like(W[2])  # F = 0, so a constant input row reaches the first LayerNorm
    X = np.ones((3, 4))
    with pytest.raises(ValueError, match="eps > 0"):
        blockhess.loss_hessian(X, X, _params(W))


def test_dense_request_over_budget_is_refused(rng):
    X, W, target, _ = ref.random_block(rng, 4, 8, 8, 32)
    params = _params(W)
    with blockhess.memory_budget(2**18):
        with pytest.raises(MemoryError, match="wrt="):
            blockhess.loss_hessian(X, target, params)
        assert blockhess.loss_hessian(X, target, params, wrt=("W_Q",)).shape == (64, 64)


@pytest.mark.parametrize("part", ["full", "outer", "functional"])
def test_loss_hessian_into_out(rng, part):
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5, B=2)
    params = _params(W)
    want = blockhess.loss_hessian(X, target, params, part=part, eps=1e-3)
    out = np.full(want.shape, np.nan)  # every entry must be written
    got = blockhess.loss_hessian(X, target, params, part=part, eps=1e-3, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    blocks = blockhess.loss_hessian(X, target, params, part=part, eps=1e-3, layout="blocks", out=out)
    assert all(np.shares_memory(b, out) for b in blocks.values())
    sub = np.empty((12, 12))
    blockhess.loss_hessian(X, target, params, wrt=("W_Q", "W_K"), part=part, eps=1e-3, out=sub)
    np.testing.assert_array_equal(sub, blockhess.loss_hessian(X, target, params, wrt=("W_Q", "W_K"), part=part, eps=1e-3))


def test_loss_hessian_out_skips_the_budget_but_not_the_checks(rng):
    X, W, target, _ = ref.random_block(rng, 3, 4, 2, 5)
    params = _params(W)
    P = params.size
    # The caller owns out: only the working memory (15.6 KiB here, a norm's Jacobians that its push
    # maps the factors with counted once, for the widest) counts, not the 41 KiB result.
    with blockhess.memory_budget(16 * 1024):
        H = blockhess.loss_hessian(X, target, params, out=np.empty((P, P)))
    with blockhess.memory_budget(1024), pytest.raises(blockhess.OutputTooLargeError, match="working memory"):
        blockhess.loss_hessian(X, target, params, out=np.empty((P, P)))
    np.testing.assert_array_equal(H, blockhess.loss_hessian(X, target, params))
    cases = [
        (TypeError, "out must be an array", [[0.0] * P] * P),
        (TypeError, "dtype float64", np.empty((P, P), dtype=np.float32)),
        (ValueError, rf"shape \({P}, {P}\)", np.empty((P, P + 1))),
        (ValueError, "C-contiguous", np.empty((P, P), order="F")),
        (ValueError, "read-only", np.lib.stride_tricks.as_strided(np.empty((P, P)), writeable=False)),
    ]
    for error, message, out in cases:
        with pytest.raises(error, match=message):
            blockhess.loss_hessian(X, target, params, out=out)
    out = np.empty((P, P))
    X_inside_out = out.reshape(-1)[:X.size].reshape(X.shape)
    X_inside_out[...] = X
    with pytest.raises(ValueError, match="shares memory"):
        blockhess.loss_hessian(X_inside_out, target, params, out=out)
