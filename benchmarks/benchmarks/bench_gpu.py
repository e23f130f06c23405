"""GPU benchmarks: blockhess on CuPy arrays against torch.func on the same GPU.

Every class raises NotImplementedError in setup (asv: skipped) without CuPy, a CUDA build of
blockhess or a GPU. Timings synchronise the stream inside time_* (kernels are asynchronous);
GPU memory and accuracy are track_* benchmarks. float64 unless a parameter says otherwise.

The same workloads drive benchmarks/gpu_bench.py (the script of benchmarks/gpu_check.sh), which
also measures achieved memory bandwidth against a device-to-device copy.

Targets (H200): LayerNorm Jacobian blocks at (L, d) = (128, 256) written at >= 70 % of the
memory bandwidth; full block loss Hessian at (L, d, d_k, d_ff) = (16, 32, 32, 64) >= 20x faster
than torch.func.hessian.
"""

from __future__ import annotations

import math

import numpy as np

SEED = 20251130
LN_SHAPES = [(128, 256), (64, 128)]
BLOCK_SHAPES = [(16, 32, 32, 64), (49, 16, 16, 64)]
TORCH_DEVICE = "cuda"  # the torch baselines run here (gpu_bench.py --torch-device cpu points it at the CPU)
EVENT_PAD_BYTES = 1 << 32  # event_time queues its launches behind a memset of this many bytes


# ---- availability -------------------------------------------------------------------------------

def gpu_modules():
    """(cupy, blockhess) or NotImplementedError (asv then skips the benchmark)."""
    try:
        import cupy
    except ImportError as err:
        raise NotImplementedError("CuPy is not installed") from err
    try:
        import blockhess
    except ImportError as err:  # pragma: no cover
        raise NotImplementedError(f"blockhess does not import: {err}") from err
    if not getattr(blockhess, "cuda_available", lambda: False)():
        raise NotImplementedError("blockhess has no CUDA build here, or no GPU is visible")
    return cupy, blockhess


def torch_cuda():
    try:
        import torch
    except ImportError as err:
        raise NotImplementedError("PyTorch is not installed") from err
    if TORCH_DEVICE == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("PyTorch has no CUDA here")
    return torch


def sync():
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def torch_sync():
    if TORCH_DEVICE == "cuda":
        torch_cuda().cuda.synchronize()


def rng(*key):
    return np.random.default_rng([SEED, *key])


# ---- workloads ----------------------------------------------------------------------------------

def ln_input(shape, dtype=np.float64):
    return rng(1, *shape).standard_normal(shape).astype(dtype)


def block_inputs(shape):
    L, d, dk, dff = shape
    g = rng(2, *shape)
    X = g.standard_normal((L, d))
    target = g.standard_normal((L, d))
    W = [g.standard_normal(s) / math.sqrt(s[0]) for s in ((d, dk), (d, dk), (d, d), (d, dff), (dff, d))]
    return X, target, W


def blockhess_block_hessian(shape):
    """Zero-argument callable: the full (P, P) MSE loss Hessian on the GPU (inputs already there)."""
    cupy, blockhess = gpu_modules()
    X, target, W = block_inputs(shape)
    params = blockhess.BlockParams(*(cupy.asarray(w) for w in W))
    Xd, Td = cupy.asarray(X), cupy.asarray(target)
    return lambda: blockhess.loss_hessian(Xd, Td, params)


def torch_reference():
    """blockhess._torch_reference: the block in PyTorch (NotImplementedError where this commit lacks it)."""
    torch_cuda()
    try:
        from blockhess import _torch_reference
    except ImportError as err:
        raise NotImplementedError(f"blockhess._torch_reference is not available at this commit: {err}") from err
    return _torch_reference


def torch_block_hessian(shape):
    """Zero-argument callable: torch.func.hessian of the same loss on the same GPU (float64)."""
    torch, reference = torch_cuda(), torch_reference()
    X, target, W = reference.as_problem(*block_inputs(shape), "mse", dtype=torch.float64, device=TORCH_DEVICE)
    loss = reference.loss_of_flat(X, target, [w.shape for w in W], "mse", fused=True)
    hess = torch.func.hessian(loss)
    w0 = reference.flatten(W)
    return lambda: hess(w0)


def blockhess_ln_blocks(shape, dtype=np.float64):
    cupy, blockhess = gpu_modules()
    X = cupy.asarray(ln_input(shape, dtype))
    return lambda: blockhess.layernorm_jacobian(X, layout="blocks")


def kernel_ln_blocks(shape, dtype=np.float64, tile_elems=0):
    """Only the LayerNorm Jacobian-blocks kernel, launched straight through the binding with a
    preallocated output: what the bandwidth target is about. Returns (launch, bytes moved)."""
    cupy, _ = gpu_modules()
    from blockhess import _backend

    L, d = shape
    X = cupy.asarray(ln_input(shape, dtype))
    out = cupy.empty((L, d, d), dtype=dtype)
    launch = getattr(_backend._cuda, "layernorm_jacobian_blocks_" + ("f64" if np.dtype(dtype) == np.float64 else "f32"))
    args = (X.data.ptr, L, d, 0.0, 0, 0, out.data.ptr, 0, cupy.cuda.get_current_stream().ptr, int(tile_elems))

    def run(_keep=(X, out)):
        launch(*args)

    return run, out.nbytes + X.nbytes


def torch_ln_blocks(shape):
    torch, reference = torch_cuda(), torch_reference()
    X = torch.as_tensor(ln_input(shape), device=TORCH_DEVICE)
    jac = torch.func.vmap(torch.func.jacrev(lambda x: reference.layernorm(x, fused=True)))
    return lambda: jac(X)


def rel_error(a, b) -> float:
    import cupy

    a = cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else (a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a))
    b = cupy.asnumpy(b) if isinstance(b, cupy.ndarray) else (b.detach().cpu().numpy() if hasattr(b, "detach") else np.asarray(b))
    a = a.reshape(b.shape).astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def cupy_pool_peak(fn) -> int:
    """Bytes the CuPy memory pool held after one call from an empty pool (= peak of that call)."""
    import cupy

    pool = cupy.get_default_memory_pool()
    sync()
    pool.free_all_blocks()
    base = pool.total_bytes()
    out = fn()
    sync()
    peak = pool.total_bytes() - base
    del out
    return int(peak)


def torch_peak(fn) -> float:
    """Bytes torch allocated on the GPU at the peak of one call (NaN when its baseline runs on the CPU)."""
    torch = torch_cuda()
    if TORCH_DEVICE != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


# ---- asv classes --------------------------------------------------------------------------------

class TimeGPULayerNormJacobianBlocks:
    """blockhess.layernorm_jacobian(layout="blocks") on the GPU (whole call) and the kernel alone."""

    params = (["blockhess", "kernel", "torch_vmap_jacrev"], LN_SHAPES)
    param_names = ("method", "shape")
    timeout = 300

    def setup(self, method, shape):
        if method == "blockhess":
            self.fn = blockhess_ln_blocks(shape)
        elif method == "kernel":
            self.fn = kernel_ln_blocks(shape)[0]
        else:
            gpu_modules()
            self.fn = torch_ln_blocks(shape)
        self.torch = method.startswith("torch")
        self._run()  # warm-up: module load, pools, cuBLAS handles

    def _run(self):
        out = self.fn()
        torch_sync() if self.torch else sync()
        return out

    def time_ln_jacobian_blocks(self, method, shape):
        self._run()


class TimeGPUBlockLossHessian:
    """Full block loss Hessian (MSE, all five matrices) on the GPU: blockhess vs torch.func.hessian."""

    params = (["blockhess", "torch_hessian"], BLOCK_SHAPES)
    param_names = ("method", "shape")
    timeout = 600
    repeat = (2, 5, 30.0)

    def setup(self, method, shape):
        gpu_modules()
        self.torch = method == "torch_hessian"
        self.fn = torch_block_hessian(shape) if self.torch else blockhess_block_hessian(shape)
        self._run()

    def _run(self):
        out = self.fn()
        torch_sync() if self.torch else sync()
        return out

    def time_block_loss_hessian(self, method, shape):
        self._run()


class TrackGPULayerNormBandwidth:
    """Achieved write bandwidth of the Jacobian-blocks kernel, as a fraction of a device-to-device
    copy's bandwidth (read + write bytes) on the same GPU."""

    params = (LN_SHAPES,)
    param_names = ("shape",)
    timeout = 300

    def setup(self, shape):
        gpu_modules()
        self.shape = shape

    def track_fraction_of_copy_bandwidth(self, shape):
        fn, nbytes = kernel_ln_blocks(shape)
        kernel = nbytes / event_time(fn)
        return kernel / copy_bandwidth(nbytes)

    track_fraction_of_copy_bandwidth.unit = "fraction"

    def track_kernel_bandwidth_GBps(self, shape):
        fn, nbytes = kernel_ln_blocks(shape)
        return nbytes / event_time(fn) / 1e9

    track_kernel_bandwidth_GBps.unit = "GB/s"


class TrackGPUBlockLossHessian:
    """GPU memory and accuracy of the full block loss Hessian."""

    params = (BLOCK_SHAPES,)
    param_names = ("shape",)
    timeout = 600

    def setup(self, shape):
        gpu_modules()

    def track_blockhess_gpu_peak_over_output(self, shape):
        P = sum(block_sizes(shape))
        return cupy_pool_peak(blockhess_block_hessian(shape)) / (8 * P * P)

    track_blockhess_gpu_peak_over_output.unit = "x output size"

    def track_torch_gpu_peak_over_output(self, shape):
        P = sum(block_sizes(shape))
        return torch_peak(torch_block_hessian(shape)) / (8 * P * P)

    track_torch_gpu_peak_over_output.unit = "x output size"

    def track_rel_error_vs_torch_cuda(self, shape):
        return rel_error(blockhess_block_hessian(shape)(), torch_block_hessian(shape)())

    track_rel_error_vs_torch_cuda.unit = "relative error"

    def track_rel_error_vs_cpu(self, shape):
        import blockhess

        X, target, W = block_inputs(shape)
        return rel_error(blockhess_block_hessian(shape)(), blockhess.loss_hessian(X, target, blockhess.BlockParams(*W)))

    track_rel_error_vs_cpu.unit = "relative error"


# ---- timing helpers shared with gpu_bench.py ----------------------------------------------------

def block_sizes(shape):
    L, d, dk, dff = shape
    return [d * dk, d * dk, d * d, d * dff, dff * d]


def event_time(fn, reps: int = 100, warmup: int = 3) -> float:
    """Seconds per call of an asynchronous launch: `reps` back-to-back calls between two CUDA events,
    queued behind a ~1 ms memset so that the GPU never waits for Python between them."""
    import cupy

    for _ in range(warmup):
        fn()
    sync()
    pad = cupy.empty(EVENT_PAD_BYTES, dtype=cupy.uint8)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    pad.fill(0)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    del pad
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / reps


def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s of a device-to-device copy moving nbytes (nbytes/2 read + nbytes/2 written): the best
    of cudaMemcpyAsync and CuPy's element-wise copy."""
    import cupy

    n = max(1, nbytes // 2 // 8)
    src = cupy.ones(n, dtype=cupy.float64)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream().ptr
    memcpy = lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, 3, stream)  # noqa: E731
    elementwise = lambda: cupy.copyto(dst, src)  # noqa: E731
    return max(2 * src.nbytes / event_time(memcpy), 2 * src.nbytes / event_time(elementwise))


def memset_bandwidth(nbytes: int) -> float:
    import cupy

    buf = cupy.empty(nbytes, dtype=cupy.uint8)
    stream = cupy.cuda.get_current_stream().ptr
    return nbytes / event_time(lambda: cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0, nbytes, stream))


def nominal_bandwidth() -> float:
    """The GPU's nominal memory bandwidth in bytes/s (from its clock and bus width, or its name)."""
    import cupy

    dev = cupy.cuda.Device().id
    rt = cupy.cuda.runtime
    try:
        clock_khz = rt.deviceGetAttribute(36, dev)  # cudaDevAttrMemoryClockRate
        bus_bits = rt.deviceGetAttribute(37, dev)  # cudaDevAttrGlobalMemoryBusWidth
        if clock_khz > 0 and bus_bits > 0:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8
    except Exception:  # noqa: BLE001 - attribute missing in this CUDA version
        pass
    name = rt.getDeviceProperties(dev)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    for key, gbps in (("H200", 4800), ("H100", 3350), ("A100", 2039), ("L40", 864)):
        if key in name:
            return gbps * 1e9
    return float("nan")


# ---- Hessian-vector products on the GPU engine ----------------------------------------------------

GPT2 = dict(norm_position="pre", norm_affine=True, bias=True, heads=12, out_proj=True, activation="gelu_tanh",
            causal=True, eps=1e-5)
# (name, spec options, L, d, d_k, d_ff, layers): the GPT-2-small-shaped block and a 4-block stack, as
# bench_family.py's CPU ratios.
HVP_SHAPES = [("gpt2 block", GPT2, 128, 768, 64, 3072, 1), ("4-block stack", dict(GPT2, heads=4), 128, 256, 64, 1024, 4)]


def hvp_problem(options, L, d, dk, dff, layers, dtype=np.float32):
    """(spec, params, X, target, v) on the host, seeded."""
    import blockhess

    spec = blockhess.BlockSpec(**options)
    if layers > 1:
        spec = blockhess.ModelSpec(spec, n_layers=layers)
    params = blockhess.BlockParams.random(spec, d=d, d_k=dk, d_ff=dff, seed=SEED, dtype=dtype)
    g = rng(3, L, d, layers)
    X, target = g.standard_normal((L, d)).astype(dtype), g.standard_normal((L, d)).astype(dtype)
    return spec, params, X, target, g.standard_normal(params.size).astype(dtype)


def blockhess_hvp(problem):
    """(one-shot loss_hvp, operator product, the operator) on the GPU engine, inputs on the GPU."""
    cupy, blockhess = gpu_modules()
    spec, params, X, target, v = problem
    dparams = blockhess.BlockParams.from_arrays(spec, {n: cupy.asarray(a) for n, a in zip(params.names, params.arrays)})
    Xd, Td, vd = cupy.asarray(X), cupy.asarray(target), cupy.asarray(v)
    op = blockhess.hessian_operator(Xd, Td, dparams)
    return (lambda: blockhess.loss_hvp(Xd, Td, dparams, vd)), (lambda: op @ vd), op


def torch_gradient_and_hvp(problem):
    """(gradient, double-backward HVP) of the same mse loss in torch on TORCH_DEVICE."""
    torch, reference = torch_cuda(), torch_reference()
    spec, params, X, target, v = problem
    dev = TORCH_DEVICE
    output_of = reference.family_of_flat(torch.as_tensor(X, device=dev), spec, params.names, params.shapes)
    T = torch.as_tensor(target, device=dev)
    flat = torch.as_tensor(np.array(params.flatten()), device=dev).requires_grad_(True)
    vt = torch.as_tensor(v, device=dev)

    def loss(w):
        return ((output_of(w) - T) ** 2).mean()

    def hvp():
        (g,) = torch.autograd.grad(loss(flat), flat, create_graph=True)
        return torch.autograd.grad(g, flat, grad_outputs=vt)[0]

    return (lambda: torch.autograd.grad(loss(flat), flat)[0]), hvp
