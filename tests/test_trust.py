"""Inputs blockhess must not trust: aliasing with out=, LayerNorm rows at the edge of the float
range or constant up to rounding, finite inputs with non-finite results, mixed dtypes, masked
arrays, np.matrix, byte order, alignment, PyTorch tensors, the memory budget and the bindings."""

import functools
import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import reference as ref
import torch

import blockhess
from blockhess import _core

L, D, DK, DFF = 5, 4, 3, 6


def _block(rng, B=None, scale=0.6):
    X, W, target, classes = ref.random_block(rng, L, D, DK, DFF, B=B, scale=scale)
    return X, blockhess.BlockParams(*W), target, classes


# --- 1. out= must never alias the caller's arrays ----------------------------------------------

@pytest.mark.parametrize("which", ["X", "target", "W_V"])
def test_out_sharing_memory_with_a_non_contiguous_input_is_refused(rng, which):
    X, params, target, _ = _block(rng)
    P = params.size
    big = np.zeros((P, P))
    # An F-ordered view of out's own memory: the internal C-contiguous copy cannot show the overlap.
    if which == "X":
        X = np.asfortranarray(X)
        view = big.reshape(-1)[: X.size].reshape(X.shape[::-1]).T
        view[...] = X
        X = view
    elif which == "target":
        view = big.reshape(-1)[: target.size].reshape(target.shape[::-1]).T
        view[...] = target
        target = view
    else:
        W = list(params.arrays)
        view = big.reshape(-1)[: W[2].size].reshape(W[2].shape[::-1]).T
        view[...] = W[2]
        W[2] = view
        params = blockhess.BlockParams(*W)
    assert not view.flags.c_contiguous
    before = big.copy()
    with pytest.raises(ValueError, match=f"out shares memory with {which}"):
        blockhess.loss_hessian(X, target, params, out=big)
    assert np.array_equal(big, before)  # the caller's data is untouched


def test_out_separate_from_inputs_is_written(rng):
    X, params, target, _ = _block(rng)
    out = np.empty((params.size, params.size))
    H = blockhess.loss_hessian(np.asfortranarray(X), target, params, out=out)
    assert H is out
    assert np.array_equal(out, blockhess.loss_hessian(X, target, params))


# --- LayerNorm rows: constant up to rounding, and at extreme scales ----------------------------

@pytest.mark.parametrize("call", ["layernorm", "jacobian", "hessian", "contract", "block"])
def test_row_constant_up_to_rounding_is_refused(rng, call):
    X = rng.standard_normal((3, 3))
    X[1] = 0.1  # the mean of (0.1, 0.1, 0.1) rounds, so the computed variance is ~1e-34, not 0
    match = r"row 1 .*zero variance.*constant up to rounding.*eps > 0"
    with pytest.raises(ValueError, match=match):
        if call == "layernorm":
            blockhess.layernorm(X)
        elif call == "jacobian":
            blockhess.layernorm_jacobian(X, layout="blocks")
        elif call == "hessian":
            blockhess.layernorm_hessian(X, layout="blocks")
        elif call == "contract":
            blockhess.layernorm_hessian_contract(X, np.ones_like(X))
        else:  # the first LayerNorm of a block with W_V = 0 sees X itself
            W = [np.zeros((3, 3))] * 5
            blockhess.block_forward(X, blockhess.BlockParams(*W))
    # With eps > 0 the same rows are fine and the result is finite.
    assert np.isfinite(blockhess.layernorm_jacobian(X, eps=1e-5, layout="blocks")).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_genuinely_varying_row_is_not_refused(dtype):
    X = np.array([[1.0, 1.0 + 1e-3, 1.0 - 1e-3]], dtype=dtype)
    J = blockhess.layernorm_jacobian(X, layout="blocks")
    assert np.isfinite(J).all()


@pytest.mark.parametrize("scale", [1e155, 1e-160, 1e300, 1e-300, 2.0**-1070])
def test_layernorm_is_scale_safe(rng, scale):
    X = rng.standard_normal((4, 6))
    Xs = X * scale
    unscaled = Xs / scale  # X up to the rounding of Xs (exact for a power of two)
    # LN is scale invariant (eps = 0): LN(sX) = LN(X), J(sX) = J(X) / s.
    assert ref.rel_err(blockhess.layernorm(Xs), blockhess.layernorm(unscaled)) <= 1e-13
    J = blockhess.layernorm_jacobian(unscaled, layout="blocks")
    magnitude = math.log10(np.abs(J).max()) - math.log10(scale)  # of the largest entry of J(sX)
    if magnitude < 300:
        Js = blockhess.layernorm_jacobian(Xs, layout="blocks")
        assert ref.rel_err(Js * scale, J) <= 1e-13
    elif magnitude > 309:  # the Jacobian itself lies beyond the float range: an error, not Inf
        with pytest.raises(blockhess.NonFiniteError, match="LayerNorm Jacobian blocks"):
            blockhess.layernorm_jacobian(Xs, layout="blocks")


def test_layernorm_at_tiny_scale_matches_autograd_of_the_rescaled_row(rng):
    X = rng.standard_normal((3, 5))
    Xs = X * 1e-160  # squaring the row underflows: the old variance lost all its digits
    unscaled = Xs / 1e-160
    Zs = blockhess.layernorm(Xs)
    assert ref.rel_err(Zs, ref.layernorm(ref.t(unscaled)).numpy()) <= 1e-14
    J = blockhess.layernorm_jacobian(Xs, layout="blocks")
    expected = ref.jacobian(lambda x: ref.layernorm(x), ref.t(unscaled)).reshape(3, 5, 3, 5)
    expected = np.stack([expected[i, :, i, :] for i in range(3)])
    assert ref.rel_err(J * 1e-160, expected) <= 1e-13


def test_layernorm_with_eps_at_extreme_scales(rng):
    X = rng.standard_normal((2, 4))
    centred = X - X.mean(axis=1, keepdims=True)
    # Far above sqrt(eps), eps no longer matters: LN(sX, eps) = LN(X, eps / s^2) = LN(X).
    assert ref.rel_err(blockhess.layernorm(X * 1e200, eps=1e-5), blockhess.layernorm(X)) <= 1e-13
    # Far below, the variance does not matter: sigma = sqrt(eps), Z = (x - mean) / sqrt(eps).
    Z = blockhess.layernorm(X * 1e-200, eps=1e-5)
    assert ref.rel_err(Z, centred * 1e-200 / math.sqrt(1e-5)) <= 1e-13
    # Below the float range altogether (2^-1074 scale): Z is 0 to within that range, never NaN.
    Z = blockhess.layernorm(X * 2.0**-1070, eps=1e-5)
    assert np.isfinite(Z).all() and np.abs(Z).max() < 1e-300


def test_layernorm_second_derivative_beyond_the_range_is_an_error(rng):
    X = rng.standard_normal((3, 4)) * 1e-160  # d2/dx2 ~ 1 / sigma^2 ~ 1e320
    with pytest.raises(blockhess.NonFiniteError, match="LayerNorm second-derivative blocks"):
        blockhess.layernorm_hessian(X, layout="blocks")


# --- finite inputs, non-finite results ----------------------------------------------------------

def test_huge_weights_name_the_stage_that_overflowed(rng):
    X, params, target, _ = _block(rng)
    W = [w * 1e160 for w in params.arrays]
    big = blockhess.BlockParams(*W)
    for call in (
        lambda: blockhess.loss_hessian(X, target, big),
        lambda: blockhess.loss_gradient(X, target, big),
        lambda: blockhess.loss_value(X, target, big),
        lambda: blockhess.block_forward(X, big),
        lambda: blockhess.block_jacobian(X, big, "W_Q"),
    ):
        with pytest.raises(blockhess.NonFiniteError, match="attention weights"):
            call()
    assert issubclass(blockhess.NonFiniteError, ValueError)


def test_huge_target_names_the_loss(rng):
    X, params, target, _ = _block(rng)
    with pytest.raises(blockhess.NonFiniteError, match="loss"):
        blockhess.loss_hessian(X, target * 1e200, params)


def test_every_derivative_checks_its_entries_as_it_writes_them(rng):
    """The derivative functions check each piece of their result for Inf/NaN while writing it (no
    second pass over a large result): every layout and wrt, with the stage named."""
    X = rng.standard_normal((4, 3))
    tiny = X * 1e-160  # LayerNorm's derivatives scale like 1/sigma (Jacobian) and 1/sigma^2
    cases = [
        (lambda: blockhess.layernorm_jacobian(tiny * 1e-150, layout="blocks"), "LayerNorm Jacobian blocks"),
        (lambda: blockhess.layernorm_jacobian(tiny * 1e-150, layout="dense"), "dense LayerNorm Jacobian"),
        (lambda: blockhess.layernorm_hessian(tiny, layout="dense"), "dense LayerNorm second derivative"),
        (lambda: blockhess.layernorm_hessian_contract(tiny, np.ones((4, 3))), "contracted LayerNorm"),
        (lambda: blockhess.layernorm(X, gamma=np.full(3, 1e308), beta=np.full(3, 1e308)), r"LN\(X\)"),
    ]
    W = rng.standard_normal((3, 3)) * 1e160
    for wrt in ("W_Q", "W_K", "X"):
        cases.append((lambda wrt=wrt: blockhess.attention_jacobian(X * 1e150, W, W, W, wrt),
                      f"attention Jacobian with respect to {wrt}"))
    big = rng.standard_normal((3, 5)) * 1e160
    for wrt, layout in (("W_1", "dense"), ("W_2", "dense"), ("W_2", "kron"), ("Y", "dense"), ("Y", "blocks")):
        cases.append((lambda wrt=wrt, layout=layout: blockhess.ffn_jacobian(X * 1e160, big, big.T, wrt, layout=layout),
                      "FFN Jacobian"))
    for call, stage in cases:
        with pytest.raises(blockhess.NonFiniteError, match=stage):
            call()


def test_component_overflow_is_an_error(rng):
    X = rng.standard_normal((4, 3))
    W = rng.standard_normal((3, 3)) * 1e160
    with pytest.raises(blockhess.NonFiniteError, match="attention output"):
        blockhess.attention(X, W, W, W)
    with pytest.raises(blockhess.NonFiniteError, match="FFN"):
        blockhess.ffn(X * 1e200, W, W)
    with pytest.raises(blockhess.NonFiniteError):
        blockhess.kron_apply(W, W, np.full((3, 3), 1e160))


# --- dtypes and array kinds ------------------------------------------------------------------------

def test_every_array_argument_takes_part_in_dtype_promotion(rng):
    X, params, target, _ = _block(rng)
    p32 = blockhess.BlockParams(*(w.astype(np.float32) for w in params.arrays))
    X32 = X.astype(np.float32)
    H = blockhess.loss_hessian(X32, target, p32)  # float64 target
    assert H.dtype == np.float64
    assert blockhess.loss_gradient(X32, target, p32).dtype == np.float64
    assert blockhess.loss_hessian(X32, target.astype(np.float32), p32).dtype == np.float32
    # The promoted result is the float64 computation on the float32 values.
    p64 = blockhess.BlockParams(*(w.astype(np.float64) for w in p32.arrays))
    assert np.array_equal(H, blockhess.loss_hessian(X32.astype(np.float64), target, p64))


def _every_function(X):
    """(name, call) for each public function taking the (L, D) array X."""
    W = np.eye(D)
    return [
        ("layernorm", lambda a: blockhess.layernorm(a)),
        ("layernorm_jacobian", lambda a: blockhess.layernorm_jacobian(a, layout="blocks")),
        ("softmax_jacobian", lambda a: blockhess.softmax_jacobian(a, layout="blocks")),
        ("attention", lambda a: blockhess.attention(a, W, W, W)),
        ("ffn", lambda a: blockhess.ffn(a, W, W)),
        ("block_forward", lambda a: blockhess.block_forward(a, blockhess.BlockParams(W, W, W, W, W))),
        ("loss_hessian", lambda a: blockhess.loss_hessian(a, X, blockhess.BlockParams(W, W, W, W, W))),
        ("kron_apply", lambda a: blockhess.kron_apply(W, W, a[:D])),
    ]


@pytest.mark.parametrize("index", range(8))
def test_masked_arrays_are_refused_everywhere(rng, index):
    X = rng.standard_normal((L, D))
    name, call = _every_function(X)[index]
    masked = np.ma.masked_array(X.copy(), mask=np.zeros_like(X, dtype=bool))
    masked.data[0, 0] = np.nan
    masked.mask[0, 0] = True
    with pytest.raises(TypeError, match="masked array"):
        call(masked)


@pytest.mark.parametrize("index", range(8))
def test_np_matrix_and_big_endian_are_accepted_everywhere(rng, index):
    X = rng.standard_normal((L, D))
    name, call = _every_function(X)[index]
    expected = call(X)
    with warnings.catch_warnings():  # np.matrix is pending deprecation; researchers still hold it
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        matrix = np.asmatrix(X)
    got_matrix = call(matrix)
    got_swapped = call(X.astype(">f8"))
    for got in (got_matrix, got_swapped):
        assert type(got) is np.ndarray
        assert np.array_equal(got, expected), name


# --- bit reproducibility whatever the alignment -----------------------------------------------------

def _at_offset(a, offset_bytes):
    """A copy of a whose data starts offset_bytes past a 64-byte boundary."""
    raw = np.empty(a.nbytes + 128, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64 + offset_bytes
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("offset", [8, 16, 24, 40])
def test_equal_inputs_give_equal_bits_whatever_the_alignment(rng, offset):
    L_, d, dk = 37, 19, 13
    X, WQ, WK, WV = (rng.standard_normal(s) for s in [(L_, d), (d, dk), (d, dk), (d, d)])
    W1, W2 = rng.standard_normal((d, 23)), rng.standard_normal((23, d))
    calls = [
        lambda *a: blockhess.attention(*a[:4]),
        lambda *a: blockhess.attention_jacobian(*a[:4], "W_Q"),
        lambda *a: blockhess.attention_jacobian(*a[:4], "W_K"),
        lambda *a: blockhess.attention_jacobian(*a[:4], "X"),
        lambda *a: blockhess.ffn(a[0], a[4], a[5]),
        lambda *a: blockhess.ffn_jacobian(a[0], a[4], a[5], "W_1", layout="kron")[1],
        lambda *a: blockhess.kron_apply(a[1], a[2], a[0][:dk, :dk]),
    ]
    args = (X, WQ, WK, WV, W1, W2)
    shifted = tuple(_at_offset(a, offset) for a in args)
    for call in calls:
        assert np.array_equal(call(*args), call(*shifted))


@pytest.mark.parametrize("offset", [8, 16, 32])
def test_block_curvature_bits_do_not_depend_on_the_weights_alignment(rng, offset):
    """One-shot block calls read aligned weights in place and copy the others (engine/graph.hpp,
    Storage::borrow): either way the same bits."""
    spec = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                               activation="gelu")
    params = blockhess.BlockParams.random(spec, d=8, d_k=3, d_ff=12, seed=5)
    shifted = blockhess.BlockParams.from_arrays(spec, dict(zip(params.names, params.arrays)))
    # BlockParams copies what it is given (into memory NumPy aligns): put misaligned copies in their
    # place so that the core sees them.
    shifted._arrays = tuple(_at_offset(w, offset) for w in params.arrays)
    assert all(w.ctypes.data % 64 == offset for w in shifted.arrays)
    X, target = rng.standard_normal((2, 7, 8)), rng.standard_normal((2, 7, 8))
    V = rng.standard_normal((params.size, 2))
    calls = [
        lambda p: blockhess.loss_hvp(X, target, p, V),
        lambda p: blockhess.loss_hessian(X, target, p),
        lambda p: blockhess.hessian_operator(X, target, p).diagonal(),
        lambda p: blockhess.loss_gradient(X, target, p),
    ]
    for call in calls:
        assert np.array_equal(call(params), call(shifted))


# --- PyTorch tensors ----------------------------------------------------------------------------------

def test_torch_cpu_tensors_in_and_out(rng):
    X = rng.standard_normal((L, D))
    Xt = torch.tensor(X, requires_grad=True)
    J = blockhess.layernorm_jacobian(Xt, layout="blocks")
    assert isinstance(J, torch.Tensor) and J.dtype == torch.float64
    assert np.array_equal(J.numpy(), blockhess.layernorm_jacobian(X, layout="blocks"))
    U, V = blockhess.ffn_jacobian(Xt, torch.eye(D, dtype=torch.float64), torch.eye(D, dtype=torch.float64),
                                  "W_2", layout="kron")
    assert isinstance(U, torch.Tensor) and isinstance(V, torch.Tensor)


def test_torch_block_and_out_tensor(rng):
    X, params, target, classes = _block(rng)
    tparams = blockhess.BlockParams(*(torch.from_numpy(w) for w in params.arrays))
    H = blockhess.loss_hessian(torch.from_numpy(X), torch.from_numpy(target), tparams)
    assert isinstance(H, torch.Tensor)
    assert np.array_equal(H.numpy(), blockhess.loss_hessian(X, target, params))
    out = torch.empty(params.size, params.size, dtype=torch.float64)
    assert blockhess.loss_hessian(X, target, tparams, out=out) is out
    assert torch.equal(out, H)
    blocks = blockhess.loss_hessian(X, torch.from_numpy(classes), tparams, loss="cross_entropy", layout="blocks")
    assert all(isinstance(b, torch.Tensor) for b in blocks.values())
    assert isinstance(tparams.flatten(), torch.Tensor)
    assert isinstance(blockhess.loss_value(torch.from_numpy(X), torch.from_numpy(target), tparams), float)


def test_torch_tensor_with_an_unsupported_dtype_names_the_argument(rng):
    with pytest.raises(TypeError, match="X must have dtype float32 or float64, got torch.bfloat16"):
        blockhess.layernorm(torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="gamma must have dtype float32 or float64, got float16"):
        blockhess.layernorm(torch.zeros(3, 4), gamma=torch.ones(4, dtype=torch.float16))


# --- the memory budget --------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["inf", "nan", "0.5", "1e3.5", "lots", "-5", "0", "4 parsecs"])
def test_bad_budget_in_the_environment_fails_at_use_not_import(value):
    code = ("import blockhess, numpy as np\n"
            "try:\n    blockhess.layernorm(np.ones((2, 3)) * np.arange(3))\n"
            "except ValueError as e:\n    print('ValueError:', e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"BLOCKHESS_MEMORY_BUDGET": value, "PATH": ""}, check=True)
    assert "ValueError: the environment variable BLOCKHESS_MEMORY_BUDGET must be a positive whole number" in done.stdout
    assert repr(value) in done.stdout


@pytest.mark.parametrize("value,nbytes", [(np.int64(2**20), 2**20), (4e9, 4 * 10**9), ("8GiB", 8 * 2**30),
                                          ("512 MB", 512 * 10**6), (1024, 1024)])
def test_budget_accepts_byte_counts(value, nbytes):
    with blockhess.memory_budget(value):
        assert blockhess.get_memory_budget() == nbytes


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.5, 1.5, -1, 0, "x"])
def test_budget_refuses_non_byte_counts(value):
    with pytest.raises(ValueError, match="positive whole number of bytes"):
        blockhess.set_memory_budget(value)


def test_budget_messages_say_what_was_asked_and_what_fits(rng):
    X = rng.standard_normal((8, 16))
    with blockhess.memory_budget(1000):
        with pytest.raises(blockhess.OutputTooLargeError) as err:
            blockhess.layernorm_jacobian(X, layout="blocks")
    msg = str(err.value)
    assert "blocks" in msg and "dense" not in msg
    assert "1000 bytes" in msg and "0.00 GiB" not in msg and "KiB" in msg


def test_component_working_memory_comes_from_their_graphs():
    # components.hpp wires the sublayer for its shapes and asks the engine's estimate: a Jacobian keeps
    # more than the forward pass, dF/dY a forward tangent per thread (at most one per input feature).
    from blockhess import _core

    forward = _core.attention_working_memory(50, 8, 4, 8, -1, 1)
    assert forward >= 2 * 50 * 50  # the (L, L) logits and weights
    assert all(_core.attention_working_memory(50, 8, 4, 8, wrt, 1) > forward for wrt in range(4))
    one, two, many = (_core.ffn_working_memory(50, 8, 64, 8, 3, threads) for threads in (1, 2, 100))
    assert two > one and many - one == 7 * (two - one)  # 100 threads run 8 tangents, one per feature of d = 8
    with pytest.raises(ValueError, match="wrt must be -1..3"):
        _core.attention_working_memory(50, 8, 4, 8, 4, 1)
    with pytest.raises(ValueError, match="kind must be 0 or 1"):
        _core.ffn_cross_working_memory(50, 8, 64, 8, 2, 1)
    with pytest.raises(ValueError, match="d_ff"):
        _core.ffn_working_memory(50, 8, 0, 8, -1, 1)


def test_budget_covers_working_memory_not_just_the_output(rng):
    # L = 20000 tokens with only the 9 entries of W_Q: the (L, L) attention matrices alone are 9.6 GB.
    X = rng.standard_normal((20000, 3))
    W = [rng.standard_normal(s) for s in [(3, 3), (3, 3), (3, 3), (3, 2), (2, 3)]]
    with pytest.raises(blockhess.OutputTooLargeError, match="working memory"):
        blockhess.loss_hessian(X, X, blockhess.BlockParams(*W), wrt=("W_Q",))
    with pytest.raises(blockhess.OutputTooLargeError, match="working memory"):
        blockhess.attention(X, W[0], W[1], W[2])
    with blockhess.memory_budget(2**20), pytest.raises(blockhess.OutputTooLargeError):
        blockhess.layernorm_jacobian(rng.standard_normal((200, 30)), wrt="gamma")
    with blockhess.memory_budget(2**20), pytest.raises(blockhess.OutputTooLargeError):
        blockhess.ffn_jacobian(rng.standard_normal((200, 30)), np.ones((30, 50)), np.ones((50, 30)), "W_1",
                               layout="kron")
    with blockhess.memory_budget(2**20), pytest.raises(blockhess.OutputTooLargeError):
        blockhess.commutation_permutation(1000, 1000)


def test_huge_eps_is_a_value_error(rng):
    with pytest.raises(ValueError, match="eps must be finite"):
        blockhess.layernorm(rng.standard_normal((2, 3)), eps=10**400)


# --- the bindings check what they write ------------------------------------------------------------

def test_bindings_check_every_array_they_write_or_read():
    X = np.random.default_rng(0).standard_normal((3, 4))
    small = np.empty(2)
    with pytest.raises(ValueError, match="'out' has the wrong shape"):
        _core.layernorm_jacobian(X, 0.0, None, 0, small)
    with pytest.raises(ValueError, match="'out' has the wrong shape"):
        _core.layernorm_hessian(X, 0.0, None, 1, small)
    with pytest.raises(ValueError, match="'gamma' has the wrong shape"):
        _core.layernorm_forward(X, 0.0, np.ones(2), None, np.empty((3, 4)))
    with pytest.raises(ValueError, match="'beta' has the wrong shape"):
        _core.layernorm_forward(X, 0.0, None, np.ones(9), np.empty((3, 4)))
    with pytest.raises(ValueError, match="'gamma' has the wrong shape"):
        _core.layernorm_jacobian(X, 0.0, np.ones(1), 2, np.empty((12, 4)))
    with pytest.raises(ValueError, match="m and n must be >= 1"):
        _core.commutation_dense(-1, -1, np.empty((1, 1)))
    W = [np.eye(4)] * 5
    X3 = X[None]
    with pytest.raises(ValueError, match="class index out of range"):
        _core.loss_gradient(X3, blockhess.BlockSpec()._core(), W, 0.0, 1, None, np.full((1, 3), 7, dtype=np.int64), None)
    with pytest.raises(ValueError, match="'W_2' has the wrong shape"):
        _core.loss_gradient(X3, blockhess.BlockSpec()._core(), W[:4] + [np.eye(5)], 0.0, 0, X3, None, None)
    with pytest.raises(ValueError, match="5 parameters expected, got 4"):
        _core.loss_gradient(X3, blockhess.BlockSpec()._core(), W[:4], 0.0, 0, X3, None, None)


TESTS = str(Path(__file__).parent)  # where the peak scripts import peak_memory from

MEASURE_PEAK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, blockhess
from peak_memory import high_water_mark, record_budget_requests

L, d, dk, dff, kind = int(sys.argv[2]), 8, 4, 8, sys.argv[3]
rng = np.random.default_rng(0)
X = rng.standard_normal((L, d))
W = [rng.standard_normal(s) / 3 for s in [(d, dk), (d, dk), (d, d), (d, dff), (dff, d)]]
params = blockhess.BlockParams(*W)
asked = record_budget_requests()
blockhess.loss_hessian(X[:4], X[:4], params, wrt=("W_Q",))  # warm up: every lazy allocation is done
before = high_water_mark()
asked.clear()
if kind == "hessian":
    blockhess.loss_hessian(X, X, params, wrt=("W_Q",))
elif kind == "attention":
    blockhess.attention_jacobian(X, W[0], W[1], W[2], "W_V")
else:  # the FFN's input blocks: a forward tangent per thread through 2,048 hidden units dominates
    W_1, W_2 = rng.standard_normal((d, 2048)) / 3, rng.standard_normal((2048, d)) / 3
    blockhess.ffn_jacobian(X[:4], W_1, W_2, "Y", layout="blocks")  # its own warm-up
    before = high_water_mark()
    asked.clear()
    blockhess.ffn_jacobian(X, W_1, W_2, "Y", layout="blocks")
estimate = max(asked)  # the result and the core's working memory (engine/working_memory.hpp, components.hpp)
peak = high_water_mark() - before
print(peak, estimate)
"""


MEASURE_DIAGONAL_PEAK = r"""
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np, blockhess
from peak_memory import high_water_mark, record_budget_requests

L, d, dk, dff, heads = 128, 96, 24, 192, 4
wrt = None if sys.argv[2] == "all" else tuple(sys.argv[2].split(","))
spec = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=heads, out_proj=True,
                           activation="gelu", causal=True)
params = blockhess.BlockParams.random(spec, d=d, d_k=dk, d_ff=dff, seed=0)
X = np.random.default_rng(0).standard_normal((L, d))
asked = record_budget_requests()
blockhess.hessian_operator(X[:4], X[:4], params, wrt=wrt).diagonal()  # warm up
op = blockhess.hessian_operator(X, X, params, wrt=wrt)
before = high_water_mark()
asked.clear()
op.diagonal()
peak = high_water_mark() - before
print(peak, max(asked))
"""


@functools.lru_cache(maxsize=None)
def _diagonal_peak(wrt: str) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", MEASURE_DIAGONAL_PEAK, TESTS, wrt], capture_output=True, text=True,
                          check=True)
    peak, estimate = map(int, done.stdout.split())
    return peak, estimate


ATTENTION_PARAMETERS = "W_Q,b_Q,W_K,b_K,W_V,b_V"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("wrt", ["W_K", ATTENTION_PARAMETERS, "gamma_1", "gamma_1,beta_1", "all"])
def test_diagonal_working_memory_estimate_covers_the_measured_peak(wrt):
    peak, estimate = _diagonal_peak(wrt)
    assert peak <= estimate + 16 * 2**20
    assert estimate <= 4 * peak + 16 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_diagonal_holds_one_nodes_factors_at_a_time():
    # The six attention parameters share one pushed factor per head: about what W_K alone takes.
    assert _diagonal_peak(ATTENTION_PARAMETERS)[0] < 1.25 * _diagonal_peak("W_K")[0]
    # The whole block's diagonal holds its largest group's factors (the first norm's gamma, pre-LN),
    # not the sum over its parameters.
    assert _diagonal_peak("all")[0] < 1.25 * _diagonal_peak("gamma_1")[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", ["hessian", "attention", "ffn"])
def test_working_memory_estimate_covers_the_measured_peak(kind):
    # L = 1500 tokens: the (L, L) matrices (18 MB each) dominate everything else.
    done = subprocess.run([sys.executable, "-c", MEASURE_PEAK, TESTS, "1500", kind], capture_output=True, text=True,
                          check=True)
    peak, estimate = map(int, done.stdout.split())
    assert peak <= estimate + 16 * 2**20  # what the budget counts covers what the call takes
    assert estimate <= 4 * peak + 16 * 2**20  # and is not a wild over-count
