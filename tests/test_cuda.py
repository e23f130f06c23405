"""The GPU path: CuPy (and torch CUDA) arrays in, CuPy arrays out.

Two kinds of tests live here:
- CPU-side tests (always run): the _cuda module, dispatch and its errors. A GPU-like array on a
  machine or build that cannot run it raises RuntimeError saying how to rebuild; host and device
  arrays mixed raise TypeError; launchers refuse bad sizes with ValueError and report launch
  failures as RuntimeError.
- GPU tests: every public function against the CPU core (float64 relative error <= 1e-12, float32
  within 1e-4), against torch CUDA autograd, and the CPU's bad-input tests on device arrays. Each
  runs twice: ``[cupy]`` on a GPU (marked ``cuda``; skips cleanly without CuPy, a CUDA build or a
  GPU) and ``[emulated]`` everywhere, on NumPy arrays with the same kernels compiled for the CPU
  (tests/kernel_emulation.py). Only the torch CUDA tests and the largest sizes need a real GPU.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import kernel_emulation
import numpy as np
import pytest
import reference as ref

import blockhess
from blockhess import _backend
from test_family import SPECS as FAMILY
from test_family import _case as family_case

try:
    import cupy as _cupy
except ImportError:  # pragma: no cover - depends on the environment
    _cupy = None

GPU = _cupy is not None and blockhess.cuda_available()
NO_GPU_REASON = "needs CuPy, a CUDA build of blockhess and a visible GPU"
_GPU_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not GPU, reason=NO_GPU_REASON)]
pytestmark = kernel_emulation.needs_emulator  # its emulated cases


def _emulated_gpu(request):
    """CuPy's NumPy stand-in, its kernels the real ones compiled for the CPU (tests/conftest.py)."""
    return request.getfixturevalue("emulated_gpu")[0]


@pytest.fixture(params=[pytest.param("cupy", marks=_GPU_MARKS), pytest.param("emulated")])
def cp(request):
    """CuPy on a GPU, or (everywhere) its NumPy stand-in with the kernels emulated on the CPU."""
    return _cupy if request.param == "cupy" else _emulated_gpu(request)


@pytest.fixture
def real_cp():
    if not GPU:
        pytest.skip(NO_GPU_REASON)
    return _cupy


@pytest.fixture(params=[pytest.param("numpy"), pytest.param("cupy", marks=_GPU_MARKS), pytest.param("emulated")])
def xp(request):
    """The array module of the inputs: numpy, cupy where the GPU path can run, and the emulated GPU."""
    return {"numpy": np, "cupy": _cupy}.get(request.param) or _emulated_gpu(request)


def emulated(cp) -> bool:
    return getattr(cp, "emulated", False)


def host(a):
    return _cupy.asnumpy(a) if _cupy is not None and isinstance(a, _cupy.ndarray) else np.asarray(a)


def rel(a, b, scale=1e-300):
    a, b = host(a).astype(np.float64), host(b).astype(np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), scale))


class FakeDeviceArray:
    """Exposes the CUDA Array Interface (what CuPy, torch and Numba device arrays have), no GPU needed."""

    def __init__(self, *shape, dtype=np.float64):
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.dtype = np.dtype(dtype)
        self.__cuda_array_interface__ = {
            "shape": self.shape, "typestr": self.dtype.str, "data": (0, False), "strides": None, "version": 3,
        }


# ---------------------------------------------------------------------------------------------
# CPU-side: the module, availability, dispatch and errors
# ---------------------------------------------------------------------------------------------

def test_cuda_available_is_a_bool():
    assert isinstance(blockhess.cuda_available(), bool)
    if _backend._cuda is None:
        assert blockhess.cuda_available() is False


@pytest.mark.skipif(_backend._cuda is None, reason="blockhess was built without CUDA")
def test_cuda_module_imports_and_counts_devices():
    mod = _backend._cuda
    n = mod.device_count()
    assert isinstance(n, int) and n >= 0
    assert blockhess.cuda_available() == (n > 0)
    for name in ("layernorm_forward", "layernorm_jacobian_blocks", "layernorm_jacobian_dense", "layernorm_hessian_blocks",
                 "layernorm_hessian_dense", "layernorm_hessian_contract", "softmax_forward", "softmax_jacobian_blocks",
                 "softmax_jacobian_dense", "softmax_hessian_blocks", "softmax_hessian_dense",
                 "softmax_hessian_contract", "softmax_vjp", "commute", "commutation_dense", "loss_hessian",
                 "block_output_hessian", "attention_forward", "attention_jacobian", "ffn_forward", "ffn_jacobian",
                 "ffn_cross_hessian"):
        for suffix in ("_f32", "_f64"):
            assert callable(getattr(mod, name + suffix)), name + suffix


@pytest.mark.skipif(_backend._cuda is None, reason="blockhess was built without CUDA")
def test_cuda_module_links_no_cuda_shared_library():
    """Static cudart, no libcuda: the module imports on machines without a GPU or driver."""
    import shutil
    import subprocess
    import sys

    if not sys.platform.startswith("linux") or shutil.which("ldd") is None:
        pytest.skip("needs ldd (Linux)")
    deps = subprocess.run(["ldd", _backend._cuda.__file__], capture_output=True, text=True, check=True).stdout
    assert "libcudart" not in deps and "libcuda." not in deps, deps


@pytest.mark.skipif(_backend._cuda is None or GPU, reason="needs the CUDA module on a machine without a GPU")
def test_without_gpu_device_count_is_zero_and_launches_fail_cleanly():
    mod = _backend._cuda
    assert mod.device_count() == 0
    assert not blockhess.cuda_available()
    with pytest.raises(RuntimeError, match="CUDA"):
        mod.layernorm_forward_f64(0, 2, 3, 0.0, 0, 0, 0, 0, 0)  # a launch error, not a crash
    with pytest.raises(RuntimeError, match="CUDA"):
        mod.synchronize(0)


@pytest.mark.skipif(_backend._cuda is None, reason="blockhess was built without CUDA")
def test_launchers_refuse_bad_sizes_before_launching():
    mod = _backend._cuda
    with pytest.raises(ValueError, match="L >= 1"):
        mod.layernorm_forward_f64(0, 0, 3, 0.0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="too long"):
        mod.layernorm_jacobian_blocks_f64(0, 2, 100_000, 0.0, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="kind"):
        mod.layernorm_jacobian_blocks_f32(0, 2, 3, 0.0, 0, 7, 0, 0, 0)
    with pytest.raises(ValueError, match="m, n"):
        mod.commute_f64(0, 0, 2, 1, 0, 0)
    with pytest.raises(ValueError, match="wrt must be 0..3"):
        mod.attention_jacobian_f64((8, (2, 3)), (8, (3, 2)), (8, (3, 2)), (8, (3, 2)), 4, (8, (4, 6)), 0)


def _fake_calls():
    F = FakeDeviceArray
    return {
        "layernorm": lambda: blockhess.layernorm(F(3, 4)),
        "layernorm_jacobian": lambda: blockhess.layernorm_jacobian(F(3, 4), layout="blocks"),
        "layernorm_hessian": lambda: blockhess.layernorm_hessian(F(3, 4)),
        "layernorm_hessian_contract": lambda: blockhess.layernorm_hessian_contract(F(3, 4), F(3, 4)),
        "softmax": lambda: blockhess.softmax(F(3, 3)),
        "softmax_jacobian": lambda: blockhess.softmax_jacobian(F(3, 3)),
        "softmax_hessian": lambda: blockhess.softmax_hessian(F(3, 3), layout="blocks"),
        "vec_r": lambda: blockhess.vec_r(F(3, 4)),
        "unvec_r": lambda: blockhess.unvec_r(F(12), 3, 4),
        "commute": lambda: blockhess.commute(F(12), 3, 4),
        "kron_apply": lambda: blockhess.kron_apply(F(2, 3), F(4, 5), F(3, 5)),
        "attention": lambda: blockhess.attention(F(4, 3), F(3, 2), F(3, 2), F(3, 3)),
        "attention_jacobian": lambda: blockhess.attention_jacobian(F(4, 3), F(3, 2), F(3, 2), F(3, 3), "W_Q"),
        "ffn": lambda: blockhess.ffn(F(4, 3), F(3, 5), F(5, 3)),
        "ffn_jacobian": lambda: blockhess.ffn_jacobian(F(4, 3), F(3, 5), F(5, 3), "W_1"),
        "ffn_cross_hessian": lambda: blockhess.ffn_cross_hessian(F(4, 3), F(3, 5), F(5, 3)),
        "BlockParams": lambda: blockhess.BlockParams(F(3, 2), F(3, 2), F(3, 3), F(3, 5), F(5, 3)),
    }


@pytest.mark.skipif(GPU, reason="this machine can run GPU arrays")
@pytest.mark.parametrize("name", sorted(_fake_calls()))
def test_gpu_array_without_usable_gpu_says_how_to_rebuild(name):
    with pytest.raises(RuntimeError, match=r"GPU array.*rebuild with CUDA.*BLOCKHESS_CUDA=ON pip install"):
        _fake_calls()[name]()


def _block_np(rng, L=3, d=4, dk=2, dff=5):
    X, W, target, classes = ref.random_block(rng, L, d, dk, dff)
    return X, blockhess.BlockParams(*W), target, classes


def test_mixing_host_and_device_arrays_is_a_type_error(rng):
    F = FakeDeviceArray
    X = rng.standard_normal((3, 4))
    Xb, params, target, _ = _block_np(rng)
    calls = [
        lambda: blockhess.layernorm(X, gamma=F(4)),
        lambda: blockhess.layernorm_hessian_contract(X, F(3, 4)),
        lambda: blockhess.kron_apply(np.ones((2, 3)), F(4, 5), np.ones((3, 5))),
        lambda: blockhess.attention(X, F(4, 2), np.ones((4, 2)), np.ones((4, 4))),
        lambda: blockhess.ffn(X, np.ones((4, 5)), F(5, 4)),
        lambda: blockhess.BlockParams(F(4, 2), *params.arrays[1:]),
        lambda: blockhess.block_forward(F(3, 4), params),
        lambda: blockhess.block_jacobian(F(3, 4), params, "W_1"),
        lambda: blockhess.loss_gradient(Xb, F(3, 4), params),
        lambda: blockhess.loss_hessian(Xb, F(3, 4), params),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="mix host"):
            call()


# ---------------------------------------------------------------------------------------------
# The same bad-input tests on both backends
# ---------------------------------------------------------------------------------------------

def test_bad_input_same_errors_on_both_backends(xp):
    good = xp.asarray(np.arange(12.0).reshape(3, 4) ** 2)
    with pytest.raises(ValueError, match="2-D"):
        blockhess.layernorm_jacobian(good.ravel())
    for dtype in (np.int64, np.complex128, np.float16):
        with pytest.raises(TypeError, match="float32 or float64"):
            blockhess.layernorm_jacobian(good.astype(dtype))
    bad = good.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.layernorm_jacobian(bad)
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        blockhess.softmax_jacobian(bad)
    with pytest.raises(ValueError, match=r"gamma must have shape \(4,\)"):
        blockhess.layernorm_jacobian(good, gamma=xp.ones(3))
    with pytest.raises(ValueError, match=r"G must have shape \(3, 4\)"):
        blockhess.layernorm_hessian_contract(good, xp.ones((4, 3)))
    with pytest.raises(ValueError, match="layout"):
        blockhess.layernorm_jacobian(good, layout="sparse")
    with pytest.raises(ValueError, match=r"row 1 .*zero variance.*eps > 0"):
        blockhess.layernorm_jacobian(xp.asarray([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]]))
    with blockhess.memory_budget(2**20):
        with pytest.raises(MemoryError, match='layout="blocks"'):
            blockhess.layernorm_hessian(xp.asarray(np.random.default_rng(1).standard_normal((64, 32))))
    with pytest.raises(ValueError, match="W_Q must have shape"):
        blockhess.attention(good, xp.ones((3, 2)), xp.ones((3, 2)), xp.ones((4, 4)))
    with pytest.raises(ValueError, match="W_2 must have shape"):
        blockhess.ffn(good, xp.ones((4, 5)), xp.ones((4, 4)))


def test_block_bad_input_on_both_backends(xp, rng):
    X, W, target, classes = ref.random_block(rng, 3, 4, 2, 5)
    params = blockhess.BlockParams(*(xp.asarray(w) for w in W))
    X, target, classes = xp.asarray(X), xp.asarray(target), xp.asarray(classes)
    with pytest.raises(ValueError, match="features"):
        blockhess.block_forward(X[:, :3], params)
    with pytest.raises(ValueError, match="shape of X"):
        blockhess.loss_hessian(X, target[:2], params)
    with pytest.raises(TypeError, match="integer class"):
        blockhess.loss_hessian(X, target, params, loss="cross_entropy")
    with pytest.raises(ValueError, match="out of range"):
        blockhess.loss_gradient(X, classes + 10, params, loss="cross_entropy")
    with pytest.raises(ValueError, match="part"):
        blockhess.loss_hessian(X, target, params, part="half")


# ---------------------------------------------------------------------------------------------
# GPU against the CPU core
# ---------------------------------------------------------------------------------------------

def _is_device_result(a):
    """A CuPy array, or a NumPy array where the GPU is emulated (its path allocates with NumPy)."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return True
    return emulated(_backend.device_module()) and isinstance(a, np.ndarray)


def _compare(gpu_out, cpu_out, dtype, scale=1e-300):
    assert _is_device_result(gpu_out), type(gpu_out)
    assert gpu_out.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 1e-4
    assert rel(gpu_out, cpu_out, scale) <= tol


@pytest.mark.parametrize("L,d", [(1, 2), (3, 5), (7, 33), (16, 256), (5, 300)])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_layernorm_gpu_matches_cpu(cp, rng, L, d, eps, affine, dtype):
    X = (rng.standard_normal((L, d)) * 1.5 + 0.3)
    gamma = rng.standard_normal(d) if affine else None
    beta = rng.standard_normal(d) if affine else None
    G = rng.standard_normal((L, d))
    dev = lambda a: None if a is None else cp.asarray(a.astype(dtype))  # noqa: E731
    Xd, gd, bd, Gd = dev(X), dev(gamma), dev(beta), dev(G)
    scale = 1.0 if d == 2 else 1e-300  # LayerNorm over 2 features is constant: derivatives are rounding noise
    _compare(blockhess.layernorm(Xd, eps, gd, bd), blockhess.layernorm(X, eps, gamma, beta), dtype)
    for layout in ("blocks", "dense") if L * d <= 512 else ("blocks",):
        _compare(blockhess.layernorm_jacobian(Xd, eps=eps, gamma=gd, layout=layout),
                 blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma, layout=layout), dtype, scale)
    for wrt in ("gamma", "beta"):
        _compare(blockhess.layernorm_jacobian(Xd, eps=eps, gamma=gd, wrt=wrt),
                 blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma, wrt=wrt), dtype)
    if d <= 64:
        for layout in ("blocks", "dense") if L * d <= 64 else ("blocks",):
            _compare(blockhess.layernorm_hessian(Xd, eps=eps, gamma=gd, layout=layout),
                     blockhess.layernorm_hessian(X, eps=eps, gamma=gamma, layout=layout), dtype, scale)
        Hb = blockhess.layernorm_hessian(Xd, eps=eps, gamma=gd, layout="blocks")
        assert bool((Hb == Hb.transpose(0, 1, 3, 2)).all())  # symmetric bit for bit
    C = blockhess.layernorm_hessian_contract(Xd, Gd, eps=eps, gamma=gd)
    _compare(C, blockhess.layernorm_hessian_contract(X, G, eps=eps, gamma=gamma), dtype, scale)
    assert bool((C == C.transpose(0, 2, 1)).all())


def test_layernorm_tiles_and_grid_stride(cp, rng):
    """Every tile size gives the same bits; more rows than one grid covers still works."""
    from blockhess import _gpu_launch

    X = cp.asarray(rng.standard_normal((37, 130)))
    ref_blocks = blockhess.layernorm_jacobian(X, layout="blocks")
    for tile in (1, 7, 130, 1000, 10**7):
        out = cp.empty_like(ref_blocks)
        _gpu_launch.ln_slab(X, 0.0, None, 0, out, None, tile_elems=tile)
        assert bool((out == ref_blocks).all()), tile
    if emulated(cp):
        return  # a million one-row blocks: minutes on the CPU emulator; the tiles above are what it checks
    many = rng.standard_normal(((1 << 20) + 3, 3))
    _compare(blockhess.layernorm(cp.asarray(many)), blockhess.layernorm(many), np.float64)
    _compare(blockhess.layernorm_jacobian(cp.asarray(many[-40_000:]), layout="blocks"),
             blockhess.layernorm_jacobian(many[-40_000:], layout="blocks"), np.float64)


@pytest.mark.parametrize("m,n", [(1, 1), (3, 3), (4, 7), (2, 300)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_gpu_matches_cpu(cp, rng, m, n, dtype):
    T = rng.standard_normal((m, n)) * 3
    Td = cp.asarray(T.astype(dtype))
    _compare(blockhess.softmax(Td), blockhess.softmax(T), dtype)
    for layout in ("blocks", "dense") if m * n <= 300 else ("blocks",):
        _compare(blockhess.softmax_jacobian(Td, layout=layout), blockhess.softmax_jacobian(T, layout=layout), dtype)
    for layout in ("blocks", "dense") if m * n <= 30 else (("blocks",) if n <= 64 else ()):
        got = blockhess.softmax_hessian(Td, layout=layout)
        _compare(got, blockhess.softmax_hessian(T, layout=layout), dtype)
        if layout == "blocks":
            assert bool((got == got.transpose(0, 1, 3, 2)).all())


def test_commutation_gpu_matches_cpu(cp, rng):
    A = rng.standard_normal((3, 5))
    Ad = cp.asarray(A)
    v = blockhess.vec_r(Ad)
    assert _is_device_result(v)
    np.testing.assert_array_equal(host(v), A.reshape(-1))
    np.testing.assert_array_equal(host(blockhess.unvec_r(v, 3, 5)), A)
    np.testing.assert_array_equal(host(blockhess.commute(v, 5, 3)), A.T.reshape(-1))
    M = rng.standard_normal((15, 7))
    np.testing.assert_array_equal(host(blockhess.commute(cp.asarray(M), 3, 5)), blockhess.commute(M, 3, 5))
    B, X = rng.standard_normal((4, 6)), rng.standard_normal((5, 6))
    _compare(blockhess.kron_apply(Ad, cp.asarray(B), cp.asarray(X)), blockhess.kron_apply(A, B, X), np.float64)
    K = blockhess.commutation_matrix(4, 6, dtype=np.float32, like=Ad)
    assert _is_device_result(K) and K.dtype == np.float32
    np.testing.assert_array_equal(host(K), blockhess.commutation_matrix(4, 6))


@pytest.mark.parametrize("L,d,dk,dv", [(1, 2, 3, 2), (5, 4, 3, 6), (9, 8, 8, 8)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_gpu_matches_cpu(cp, rng, L, d, dk, dv, dtype):
    args = [rng.standard_normal(s) for s in ((L, d), (d, dk), (d, dk), (d, dv))]
    dargs = [cp.asarray(a.astype(dtype)) for a in args]
    _compare(blockhess.attention(*dargs), blockhess.attention(*args), dtype)
    for wrt in ("W_Q", "W_K", "W_V", "X"):
        _compare(blockhess.attention_jacobian(*dargs, wrt), blockhess.attention_jacobian(*args, wrt), dtype)


@pytest.mark.parametrize("L,d,f,e", [(1, 2, 3, 2), (5, 4, 7, 3), (8, 6, 12, 6)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_ffn_gpu_matches_cpu(cp, rng, L, d, f, e, dtype):
    args = [rng.standard_normal(s) for s in ((L, d), (d, f), (f, e))]
    dargs = [cp.asarray(a.astype(dtype)) for a in args]
    _compare(blockhess.ffn(*dargs), blockhess.ffn(*args), dtype)
    for wrt in ("W_1", "W_2", "Y"):
        _compare(blockhess.ffn_jacobian(*dargs, wrt), blockhess.ffn_jacobian(*args, wrt), dtype)
    _compare(blockhess.ffn_jacobian(*dargs, "Y", layout="blocks"), blockhess.ffn_jacobian(*args, "Y", layout="blocks"), dtype)
    for layout in ("blocks", "dense"):
        _compare(blockhess.ffn_cross_hessian(*dargs, layout=layout), blockhess.ffn_cross_hessian(*args, layout=layout), dtype)


BLOCK_SHAPES = [(1, 3, 4, 2, 5), (2, 5, 3, 4, 6), (3, 4, 6, 6, 9), (1, 16, 8, 8, 16)]


@pytest.mark.parametrize("B,L,d,dk,dff", BLOCK_SHAPES)
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_block_gpu_matches_cpu(cp, rng, B, L, d, dk, dff, loss):
    X, W, target, classes = ref.random_block(rng, L, d, dk, dff, B=B)
    tgt = target if loss == "mse" else classes
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    Xd, tgtd = cp.asarray(X), cp.asarray(tgt)
    f64 = np.float64
    _compare(blockhess.block_forward(Xd, dparams, eps=1e-3), blockhess.block_forward(X, params, eps=1e-3), f64)
    assert abs(blockhess.loss_value(Xd, tgtd, dparams, loss=loss) - blockhess.loss_value(X, tgt, params, loss=loss)) \
        <= 1e-12 * abs(blockhess.loss_value(X, tgt, params, loss=loss))
    _compare(blockhess.loss_gradient(Xd, tgtd, dparams, loss=loss, eps=1e-3),
             blockhess.loss_gradient(X, tgt, params, loss=loss, eps=1e-3), f64)
    for part in ("full", "outer", "functional"):
        H = blockhess.loss_hessian(Xd, tgtd, dparams, loss=loss, part=part, eps=1e-3)
        _compare(H, blockhess.loss_hessian(X, tgt, params, loss=loss, part=part, eps=1e-3), f64)
        assert bool((H == H.T).all())  # symmetric bit for bit
    blocks = blockhess.loss_hessian(Xd, tgtd, dparams, loss=loss, layout="blocks", wrt=("W_K", "W_1"))
    want = blockhess.loss_hessian(X, tgt, params, loss=loss, layout="blocks", wrt=("W_K", "W_1"))
    assert set(blocks) == set(want)
    for key in want:
        _compare(blocks[key], want[key], f64)
    for name in params.names:
        _compare(blockhess.block_jacobian(Xd[0], dparams, name), blockhess.block_jacobian(X[0], params, name), f64)


@pytest.mark.parametrize("name", sorted(FAMILY))
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy"])
def test_family_loss_hessian_gpu_matches_cpu(cp, rng, name, loss):
    """Every block of the family x loss x part x batch: the engine's assembly on the GPU against the
    CPU core (float64 <= 1e-12; exactly symmetric), a wrt subset, and float32 (close); the forward
    pass and a Jacobian (the engine on host copies), the loss and the gradient (the GPU engine) equal
    the CPU's, on the device."""
    spec = FAMILY[name]
    for B in (None, 3):
        X, target, params = family_case(rng, spec, B, "mse" if loss == "mse" else "cross_entropy")
        head = None
        if loss == "pooled_cross_entropy":
            head = (rng.standard_normal((X.shape[-1], 3)), rng.standard_normal(3))
            target = rng.integers(0, 3, () if B is None else (B,))
        dparams = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a) for n, a in zip(params.names, params.arrays)})
        dhead = None if head is None else tuple(cp.asarray(h) for h in head)
        Xd, Td = cp.asarray(X), cp.asarray(target)
        for part in ("full", "outer", "functional"):
            H = blockhess.loss_hessian(Xd, Td, dparams, loss=loss, part=part, head=dhead)
            _compare(H, blockhess.loss_hessian(X, target, params, loss=loss, part=part, head=head), np.float64)
            assert bool((H == H.T).all())  # symmetric bit for bit
        wrt = params.names[1::2]
        blocks = blockhess.loss_hessian(Xd, Td, dparams, loss=loss, layout="blocks", wrt=wrt, head=dhead)
        want = blockhess.loss_hessian(X, target, params, loss=loss, layout="blocks", wrt=wrt, head=head)
        for key in want:
            _compare(blocks[key], want[key], np.float64)
        Z = blockhess.block_forward(Xd, dparams)
        assert _backend.is_device_array(Z)
        _compare(Z, blockhess.block_forward(X, params), np.float64)
        _compare(blockhess.loss_gradient(Xd, Td, dparams, loss=loss, head=dhead),
                 blockhess.loss_gradient(X, target, params, loss=loss, head=head), np.float64)
        value = blockhess.loss_value(X, target, params, loss=loss, head=head)  # the GPU engine's, to rounding
        assert abs(blockhess.loss_value(Xd, Td, dparams, loss=loss, head=dhead) - value) <= 1e-12 * abs(value)
        X1 = X if B is None else X[0]
        _compare(blockhess.block_jacobian(cp.asarray(X1), dparams, params.names[-1]),
                 blockhess.block_jacobian(X1, params, params.names[-1]), np.float64)
    p32 = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a.astype(np.float32)) for n, a in zip(params.names, params.arrays)})
    h32 = None if head is None else tuple(cp.asarray(h.astype(np.float32)) for h in head)
    T32 = cp.asarray(target.astype(np.float32) if loss == "mse" else target)
    _compare(blockhess.loss_hessian(cp.asarray(X.astype(np.float32)), T32, p32, loss=loss, head=h32),
             blockhess.loss_hessian(X, target, params, loss=loss, head=head), np.float32)


@pytest.mark.parametrize("name", sorted(FAMILY))
@pytest.mark.parametrize("loss", ["mse", "cross_entropy", "pooled_cross_entropy"])
def test_family_hessian_vector_products_run_on_the_gpu_engine(cp, rng, name, loss):
    """Every block of the family x loss (the pooled one through a head W_C, b_C) x part, one sample
    and a batch, float64 and float32: loss_hvp, the operator's products and loss value, and the
    gradient run the engine on the GPU (the operator holds the GPU engine's), against the CPU core:
    float64 <= 1e-12, float32 close."""
    spec = FAMILY[name]
    for B in (None, 3):
        X, target, params = family_case(rng, spec, B, "mse" if loss == "mse" else "cross_entropy")
        head = None
        if loss == "pooled_cross_entropy":
            head = (rng.standard_normal((X.shape[-1], 3)), rng.standard_normal(3))
            target = rng.integers(0, 3, () if B is None else (B,))
        V = rng.standard_normal((params.size, 2))
        for dtype in (np.float64, np.float32):
            dparams = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a.astype(dtype))
                                                               for n, a in zip(params.names, params.arrays)})
            dhead = None if head is None else tuple(cp.asarray(h.astype(dtype)) for h in head)
            Xd, Vd = cp.asarray(X.astype(dtype)), cp.asarray(V.astype(dtype))
            Td = cp.asarray(target.astype(dtype) if loss == "mse" else target)
            for part in ("full", "outer", "functional"):
                want = blockhess.loss_hvp(X, target, params, V, loss=loss, part=part, head=head)
                _compare(blockhess.loss_hvp(Xd, Td, dparams, Vd, loss=loss, part=part, head=dhead), want, dtype)
                op = blockhess.hessian_operator(Xd, Td, dparams, loss=loss, part=part, head=dhead)
                assert op._gpu_op is not None
                _compare(op @ Vd[:, 0], want[:, 0], dtype)
                assert abs(op.loss_value - blockhess.loss_value(X, target, params, loss=loss, head=head)) <= (
                    1e-12 if dtype == np.float64 else 1e-5)
            _compare(blockhess.loss_gradient(Xd, Td, dparams, loss=loss, head=dhead),
                     blockhess.loss_gradient(X, target, params, loss=loss, head=head), dtype)


_GPT2_LIKE = blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                                 activation="gelu_tanh", causal=True, eps=1e-5)
MODELS = {  # name: (spec, what X is, its losses)
    "stack": (blockhess.ModelSpec(_GPT2_LIKE, n_layers=3, final_norm=True), "X", ("mse", "cross_entropy")),
    "vit": (blockhess.ModelSpec(_GPT2_LIKE, n_layers=2, final_norm=True, patch_dim=5, n_positions=6, classes=4,
                                class_token=True), "patches", ("cross_entropy", "pooled_cross_entropy")),
    "vit, mean-pooled": (blockhess.ModelSpec(_GPT2_LIKE, n_layers=2, final_norm=True, patch_dim=5, n_positions=6,
                                             classes=4), "patches", ("pooled_cross_entropy",)),
    "gpt2 lm": (blockhess.ModelSpec(_GPT2_LIKE, n_layers=2, final_norm=True, vocab_size=13, n_positions=6,
                                    lm_head=True), "ids", ("next_token", "cross_entropy")),
}


def model_case(rng, name: str, loss: str, B: int = 3, L: int = 5):
    """X (a language model's token ids, repeated; a ViT's patches), the loss's target and the model."""
    spec, reads, _ = MODELS[name]
    params = blockhess.BlockParams.random(spec, d=8, d_k=4, d_ff=12, seed=7)
    X = (rng.integers(0, 6, size=(B, L)) if reads == "ids"
         else rng.standard_normal((B, L, spec.patch_dim or params.d)))
    width, tokens = (spec.vocab_size if spec.lm_head else spec.classes or params.d), L + spec.class_token
    if loss == "mse":
        return X, rng.standard_normal((B, tokens, width)), params
    if loss == "pooled_cross_entropy":
        return X, rng.integers(0, width, size=B), params
    target = rng.integers(0, width, size=(B, tokens))
    if loss == "next_token":
        target[0, 1] = -100
    return X, target, params


@pytest.mark.parametrize("name,loss", [(n, loss) for n in MODELS for loss in MODELS[n][2]])
def test_models_hessian_vector_products_run_on_the_gpu_engine(cp, rng, name, loss):
    """A stack, a ViT (class token, positions, classifier; and without the class token, its tokens'
    mean pooled) and a GPT-2-like language model (token embedding, positions, tied LM head) x their
    losses x part, float64 and float32: loss_hvp, the
    operator's products and loss value, and the gradient run the engine on the GPU, against the
    CPU core: float64 <= 1e-12, float32 close."""
    X, target, params = model_case(rng, name, loss)
    spec = params.spec
    V = rng.standard_normal((params.size, 2))
    for dtype in (np.float64, np.float32):
        dparams = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a.astype(dtype))
                                                           for n, a in zip(params.names, params.arrays)})
        Xd = cp.asarray(X if MODELS[name][1] == "ids" else X.astype(dtype))
        Td, Vd = cp.asarray(target.astype(dtype) if loss == "mse" else target), cp.asarray(V.astype(dtype))
        for part in ("full", "outer", "functional"):
            want = blockhess.loss_hvp(X, target, params, V, loss=loss, part=part)
            _compare(blockhess.loss_hvp(Xd, Td, dparams, Vd, loss=loss, part=part), want, dtype)
            op = blockhess.hessian_operator(Xd, Td, dparams, loss=loss, part=part)
            assert op._gpu_op is not None
            _compare(op @ Vd[:, 1], want[:, 1], dtype)
        _compare(blockhess.loss_gradient(Xd, Td, dparams, loss=loss),
                 blockhess.loss_gradient(X, target, params, loss=loss), dtype)


class _LinearOperatorStandIn:
    """cupyx.scipy.sparse.linalg.LinearOperator's constructor, for the emulated GPU (no cupyx)."""

    def __init__(self, shape, matvec, matmat, rmatvec, dtype):
        self.shape, self.matvec, self.matmat, self.dtype = shape, matvec, matmat, dtype


def test_the_operator_on_gpu_vectors_and_to_cupyx(cp, rng, monkeypatch):
    """The operator built from GPU arrays: products of GPU vectors and its diagonal on the device,
    equal to the CPU's; to_cupyx() for CuPy's solvers (on a GPU, its top eigenvalue by cupyx's eigsh)."""
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5, B=2)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    op = blockhess.hessian_operator(cp.asarray(X), cp.asarray(target), dparams)
    on_host = blockhess.hessian_operator(X, target, blockhess.BlockParams(*W))
    v, V = rng.standard_normal(op.shape[0]), rng.standard_normal((op.shape[0], 3))
    _compare(op @ cp.asarray(v), on_host @ v, np.float64)
    _compare(op.matmat(cp.asarray(V)), on_host.matmat(V), np.float64)
    _compare(op.diagonal(), on_host.diagonal(), np.float64)
    if emulated(cp):
        linalg = types.SimpleNamespace(LinearOperator=_LinearOperatorStandIn)
        for name, module in (("cupyx", types.SimpleNamespace(scipy=None)), ("cupyx.scipy", types.SimpleNamespace()),
                             ("cupyx.scipy.sparse", types.SimpleNamespace()), ("cupyx.scipy.sparse.linalg", linalg)):
            monkeypatch.setitem(sys.modules, name, module)
        A = op.to_cupyx()
        assert A.shape == op.shape and A.dtype == op.dtype
        _compare(A.matvec(cp.asarray(v)), on_host @ v, np.float64)
    else:
        from cupyx.scipy.sparse.linalg import eigsh

        top = float(eigsh(op.to_cupyx(), k=1, which="LA", return_eigenvectors=False)[0])
        want = float(on_host.eigsh(k=1, return_eigenvectors=False)[0])
        assert abs(top - want) <= 1e-8 * abs(want)


def test_to_cupyx_without_cupy_says_how_to_get_it(rng):
    if importlib.util.find_spec("cupyx") is not None:
        pytest.skip("CuPy is installed")
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5)
    with pytest.raises(ImportError, match=r"blockhess\[cuda\]"):
        blockhess.hessian_operator(X, target, blockhess.BlockParams(*W)).to_cupyx()


def test_a_stacks_whole_hessian_gpu_matches_cpu(cp, rng):
    """A 2-layer stack: the last layer's block assembles on the GPU; with the lower layer in the
    selection (the per-token factors do not reach it) the host engine's exact products fill H,
    uploaded into the device result. Both against the CPU core, and the lower layer's Jacobian."""
    spec = blockhess.ModelSpec(FAMILY["pre-everything-heads2"], n_layers=2, final_norm=True)
    params = blockhess.BlockParams.random(spec, d=4, d_k=2, d_ff=5, seed=1)
    X, T = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    dparams = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a) for n, a in zip(params.names, params.arrays)})
    for wrt in (("h.1", "ln_f"), None):
        H = blockhess.loss_hessian(cp.asarray(X), cp.asarray(T), dparams, wrt=wrt)
        _compare(H, blockhess.loss_hessian(X, T, params, wrt=wrt), np.float64)
        assert bool((H == H.T).all())
    _compare(blockhess.block_jacobian(cp.asarray(X[0]), dparams, "h.0.W_V"),
             blockhess.block_jacobian(X[0], params, "h.0.W_V"), np.float64)


@pytest.mark.parametrize("name", ["pre-everything-heads2", "post-everything", "rmsnorm"])
def test_family_block_output_hessian_gpu_matches_cpu(cp, rng, name):
    spec = FAMILY[name]
    X, _, params = family_case(rng, spec, None, "mse")
    dparams = blockhess.BlockParams.from_arrays(spec, {n: cp.asarray(a) for n, a in zip(params.names, params.arrays)})
    names = params.names
    for a, b in ((names[0], names[1]), (names[-1], names[2]), (names[3], names[3])):
        _compare(blockhess.block_output_hessian(cp.asarray(X), dparams, a, b),
                 blockhess.block_output_hessian(X, params, a, b), np.float64)


def test_gpu_hessian_non_finite_is_refused(cp):
    """The finiteness flag the GPU assembly reads back: an overflowing Hessian raises, as on the CPU."""
    X = np.full((1, 2, 3), 1e300) * np.array([1.0, -1.0, 0.5])
    W = [np.full(s, 1e200) for s in ((3, 2), (3, 2), (3, 3), (3, 4), (4, 3))]
    params = blockhess.BlockParams(*W)
    with pytest.raises(ValueError) as cpu_error:
        blockhess.loss_hessian(X, np.zeros_like(X), params)
    with pytest.raises(ValueError) as gpu_error:
        blockhess.loss_hessian(cp.asarray(X), cp.zeros(X.shape), blockhess.BlockParams(*(cp.asarray(w) for w in W)))
    assert type(gpu_error.value) is type(cpu_error.value)


class _ForeignDeviceInts:
    """What matters of a torch CUDA integer tensor here: a GPU array (CUDA Array Interface) whose
    dtype NumPy cannot read (torch.int64). The GPU run found class targets like it refused."""

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype = a.shape, "torch.int64"
        self.__cuda_array_interface__ = a.__cuda_array_interface__

    def __array__(self, dtype=None, copy=None):  # the emulated cupy.asarray reads it through this
        return np.asarray(self._a, dtype=dtype)


def test_class_target_of_a_foreign_gpu_array_is_accepted(cp, rng):
    if not emulated(cp):
        pytest.skip("real torch CUDA tensors: test_torch_cuda_tensors_are_accepted_without_copies")
    X, W, _, classes = ref.random_block(rng, 3, 4, 2, 5, B=2)
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    H = blockhess.loss_hessian(cp.asarray(X), _ForeignDeviceInts(cp.asarray(classes)), dparams, loss="cross_entropy")
    _compare(H, blockhess.loss_hessian(X, classes, params, loss="cross_entropy"), np.float64)


def test_block_output_hessian_and_float32_gpu(cp, rng):
    X, W, target, _ = ref.random_block(rng, 3, 4, 2, 5)
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    for a, b in (("W_Q", "W_K"), ("W_2", "W_V"), ("W_1", "W_1")):
        _compare(blockhess.block_output_hessian(cp.asarray(X), dparams, a, b),
                 blockhess.block_output_hessian(X, params, a, b), np.float64)
    p32 = blockhess.BlockParams(*(cp.asarray(w.astype(np.float32)) for w in W))
    H32 = blockhess.loss_hessian(cp.asarray(X.astype(np.float32)), cp.asarray(target.astype(np.float32)), p32)
    _compare(H32, blockhess.loss_hessian(X, target, params), np.float32)


def test_loss_hessian_into_out_gpu(cp, rng):
    X, W, target, _ = ref.random_block(rng, 4, 3, 2, 5, B=2)
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    Xd, Td = cp.asarray(X), cp.asarray(target)
    P = params.size
    out = cp.full((P, P), np.nan)  # every entry must be written
    H = blockhess.loss_hessian(Xd, Td, dparams, part="functional", out=out)
    assert H is out
    _compare(H, blockhess.loss_hessian(X, target, params, part="functional"), np.float64)
    _compare(blockhess.loss_hessian(Xd, Td, dparams, out=out), blockhess.loss_hessian(X, target, params), np.float64)
    with pytest.raises(TypeError, match="mix host"):
        blockhess.loss_hessian(Xd, Td, dparams, out=np.empty((P, P)))
    with pytest.raises(TypeError, match="dtype float64"):
        blockhess.loss_hessian(Xd, Td, dparams, out=cp.empty((P, P), dtype=np.float32))


def test_gpu_inputs_any_layout_and_stream(cp, rng):
    X = rng.standard_normal((6, 9))
    want = blockhess.layernorm_hessian(X, layout="blocks")
    Xd = cp.asarray(X)
    np.testing.assert_array_equal(host(blockhess.layernorm_hessian(cp.asfortranarray(Xd), layout="blocks")), host(
        blockhess.layernorm_hessian(Xd, layout="blocks")))
    wide = cp.zeros((6, 18))
    wide[:, ::2] = Xd
    _compare(blockhess.layernorm_hessian(wide[:, ::2], layout="blocks"), want, np.float64)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        out = blockhess.layernorm_hessian(Xd, layout="blocks")
    stream.synchronize()
    _compare(out, want, np.float64)


# ---------------------------------------------------------------------------------------------
# GPU against torch CUDA autograd (and torch CUDA tensors as inputs)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def torch_cuda(real_cp):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


@pytest.mark.cuda
def test_gpu_against_torch_cuda_autograd(torch_cuda, real_cp, rng):
    cp = real_cp
    torch = torch_cuda
    from torch.func import hessian, jacrev

    dev = torch.device("cuda")
    T = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), device=dev)  # noqa: E731
    L, d = 5, 6
    X = rng.standard_normal((L, d))
    f = lambda x: ref.layernorm(x, 1e-3)  # noqa: E731
    J = jacrev(f)(T(X)).reshape(L * d, L * d)
    assert rel(blockhess.layernorm_jacobian(cp.asarray(X), eps=1e-3), J.cpu().numpy()) <= 1e-10
    Hs = hessian(f)(T(X)).reshape((L * d) ** 2, L * d)
    assert rel(blockhess.layernorm_hessian(cp.asarray(X), eps=1e-3), Hs.cpu().numpy()) <= 1e-10

    args = [rng.standard_normal(s) for s in ((L, d), (d, 3), (d, 3), (d, d))]
    for k, wrt in enumerate(("X", "W_Q", "W_K", "W_V")):
        def F_of(w, k=k):
            a = [T(x) for x in args]
            a[k] = w
            return ref.attention(*a)

        Jt = jacrev(F_of)(T(args[k])).reshape(L * d, -1).cpu().numpy()
        assert rel(blockhess.attention_jacobian(*(cp.asarray(a) for a in args), wrt), Jt) <= 1e-10

    Xb, W, target, _ = ref.random_block(rng, 4, 4, 3, 6, B=2)
    shapes = [w.shape for w in W]
    v0 = torch.cat([T(w).reshape(-1) for w in W])
    Xt, tt = T(Xb), T(target)

    def loss_of(v):
        return ref.block_loss(ref.transformer_block(Xt, *ref.unflatten(v, shapes), eps=1e-3), tt, "mse")

    Ht = hessian(loss_of)(v0).cpu().numpy()
    H = blockhess.loss_hessian(cp.asarray(Xb), cp.asarray(target), blockhess.BlockParams(*(cp.asarray(w) for w in W)),
                               eps=1e-3)
    assert rel(H, Ht) <= 1e-10


@pytest.mark.cuda
def test_torch_cuda_tensors_are_accepted_without_copies(torch_cuda, real_cp, rng):
    torch = torch_cuda
    X = rng.standard_normal((4, 6))
    Xt = torch.as_tensor(X, device="cuda")
    out = blockhess.layernorm_jacobian(Xt, layout="blocks")
    # torch in, torch out: a CUDA tensor on the input's device (DLPack both ways, no host round trip)
    assert isinstance(out, torch.Tensor) and out.device == Xt.device and out.dtype == torch.float64
    assert rel(out.cpu().numpy(), blockhess.layernorm_jacobian(X, layout="blocks")) <= 1e-12
    with pytest.raises(TypeError, match="mix host"):
        blockhess.layernorm(Xt, gamma=np.ones(6))
    # the engine's GPU assembly on torch CUDA tensors: a block of the family, torch CUDA out
    spec = FAMILY["pre-everything-heads2"]
    Xb, target, params = family_case(rng, spec, 2, "cross_entropy")
    tparams = blockhess.BlockParams.from_arrays(
        spec, {n: torch.as_tensor(a, device="cuda") for n, a in zip(params.names, params.arrays)})
    H = blockhess.loss_hessian(torch.as_tensor(Xb, device="cuda"), torch.as_tensor(target, device="cuda"), tparams,
                               loss="cross_entropy")
    assert isinstance(H, torch.Tensor) and H.is_cuda
    assert rel(H.cpu().numpy(), blockhess.loss_hessian(Xb, target, params, loss="cross_entropy")) <= 1e-12


def test_speed_sanity_block_hessian_at_benchmark_size(cp, rng):
    """The benchmark shape (16, 32, 32, 64) runs and agrees with the CPU core."""
    if emulated(cp):
        pytest.skip("a 7168 x 7168 Hessian is too large for the CPU kernel emulator")
    X, W, target, _ = ref.random_block(rng, 16, 32, 32, 64)
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(cp.asarray(w) for w in W))
    H = blockhess.loss_hessian(cp.asarray(X), cp.asarray(target), dparams)
    assert H.shape == (7168, 7168) and math.isfinite(float(cp.abs(H).max()))
    _compare(H, blockhess.loss_hessian(X, target, params), np.float64)


def test_a_vit_on_the_gpu_matches_cpu(cp, rng):
    """A 2-block ViT with a class token, positions and its classifier on GPU arrays: the last block's
    Hessian assembled on the device, the whole model's through the host engine's products (the
    patch embedding, class token and positions are below the attention), the gradient, forward
    pass and diagonal from host copies; all against the CPU core."""
    vit = blockhess.ModelSpec(blockhess.BlockSpec(norm_position="pre", norm_affine=True), n_layers=2, final_norm=True,
                              patch_dim=6, n_positions=5, classes=3, class_token=True)
    params = blockhess.BlockParams.random(vit, d=4, d_k=2, d_ff=5, seed=2)
    X, y = rng.standard_normal((2, 4, 6)), np.array([0, 2])
    params_d = blockhess.BlockParams.from_arrays(vit, {n: cp.asarray(a) for n, a in zip(params.names, params.arrays)})
    Xd, yd = cp.asarray(X), cp.asarray(y)
    kwargs = dict(loss="pooled_cross_entropy")
    for wrt in (("h.1", "ln_f", "W_C", "b_C"), None):
        _compare(blockhess.loss_hessian(Xd, yd, params_d, wrt=wrt, **kwargs),
                 blockhess.loss_hessian(X, y, params, wrt=wrt, **kwargs), np.float64)
    _compare(blockhess.loss_gradient(Xd, yd, params_d, **kwargs), blockhess.loss_gradient(X, y, params, **kwargs),
             np.float64)
    _compare(blockhess.block_forward(Xd, params_d), blockhess.block_forward(X, params), np.float64)
    _compare(blockhess.hessian_operator(Xd, yd, params_d, **kwargs).diagonal(),
             blockhess.hessian_operator(X, y, params, **kwargs).diagonal(), np.float64)


def test_a_language_models_gpu_ids_with_host_weights_are_a_type_error(cp, rng):
    """Token ids on the GPU and weights on the host mix the two sides: the TypeError that says so,
    as for any other input."""
    lm = blockhess.ModelSpec(blockhess.BlockSpec(), vocab_size=7)
    lm_params = blockhess.BlockParams.random(lm, d=4, d_k=2, d_ff=5)
    ids = cp.asarray(rng.integers(0, 7, size=(2, 5)))
    with pytest.raises(TypeError, match="mix host"):
        blockhess.block_forward(ids, lm_params)
    with pytest.raises(TypeError, match="mix host"):
        blockhess.loss_gradient(ids, ids, lm_params, loss="cross_entropy")
