"""The GPU backend (cuda/src/backend.cu) on the CPU kernel emulator: its row operations (the
engine's per-token work, engine/row_ops.hpp, one kernel each) against the host backend and NumPy,
with the grid cut to 3 blocks as well so that the kernels' grid-stride loops go round; and its
products, with a stand-in for the cuBLAS calls it makes (tests/cuda_emulator/cublas.cpp, which checks their arguments as cuBLAS
documents them): every layout the engine hands a backend (row- or column-major operands, a head's
columns inside a wider array, one row or column, depth 0), assigned or accumulated, alone or
batched, in float64 and float32, against NumPy and against the host backend. cuBLAS is
column-major and the engine row-major; these are the mappings a GPU would get silently wrong, so
two deliberately broken variants of the backend (an operation flipped, the operands not swapped)
must fail here.

On a GPU machine the same products run on the real cuBLAS (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import ctypes

import background_builds
import kernel_emulation
import numpy as np
import pytest

pytestmark = kernel_emulation.needs_emulator

P = ctypes.c_void_p


def _load(path):
    lib = ctypes.CDLL(str(path))
    for name in ("product_f64", "product_f32"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_long, P, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, P,
                       ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_long, P, ctypes.c_long, ctypes.c_int,
                       ctypes.c_long, ctypes.c_double, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_long]
    lib.cublas_standin_last_stream.restype = ctypes.c_size_t
    for name in ("activation_forward", "scale_entries", "activation_cotangent_tangent"):
        for suffix in ("_f64", "_f32"):
            getattr(lib, name + suffix).restype = ctypes.c_int
    return lib


@pytest.fixture(scope="module")
def lib():
    background_builds.result("kernel emulator", kernel_emulation.build_all)
    return _load(kernel_emulation.build_backend_probe())


@pytest.fixture(scope="module", params=["full grid", "3 blocks"])
def row_lib(request, lib):
    if request.param == "full grid":
        return lib
    return _load(kernel_emulation.build_backend_probe(edits={"kMaxGridX = 1u << 20;": "kMaxGridX = 3u;"}))


def ptr(a: np.ndarray | None) -> P:
    return P(None if a is None else a.__array_interface__["data"][0])


# ---- row operations -------------------------------------------------------------------------------

COUNT = 1000  # more items than 3 blocks of 256 threads: the grid-stride loop goes round
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}


def run_rows(lib, name, dtype, *args):
    fn = getattr(lib, name + ("_f64" if dtype == np.float64 else "_f32"))
    message = ctypes.create_string_buffer(512)
    converted = [ptr(a) if a is None or isinstance(a, np.ndarray) else a for a in args]
    assert fn(*converted, ctypes.c_long(COUNT), message, ctypes.c_long(512)) == 0, message.value.decode()


def outputs(dtype, n):
    """n arrays of COUNT items filled with NaN, and 5 sentinels past the end each (never written)."""
    return [np.full(COUNT + 5, np.nan, dtype) for _ in range(n)]


def _activation(name, x):
    """phi(x) from its definition (activation.hpp), in float64."""
    from math import erf

    if name == "relu":
        return np.maximum(x, 0)
    if name == "gelu":
        return x * (1 + np.vectorize(erf)(x / np.sqrt(2))) / 2
    if name == "gelu_tanh":
        return x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3))) / 2
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_the_activation_on_the_gpu_is_the_hosts(row_lib, dtype, kind):
    x = (3 * np.random.default_rng(1).standard_normal(COUNT)).astype(dtype)
    smooth = kind != "relu"
    results = []
    for gpu in (0, 1):
        y, first, second = outputs(dtype, 3)
        run_rows(row_lib, "activation_forward", dtype, gpu, ACTIVATIONS[kind], x, y, first, second if smooth else None)
        assert np.isnan(y[COUNT:]).all() and np.isnan(first[COUNT:]).all() and np.isnan(second[COUNT:]).all()
        assert np.isnan(second).all() != smooth  # phi'' written for a smooth phi only
        results.append((y[:COUNT], first[:COUNT], second[:COUNT]))
    for host, gpu in zip(*results):
        np.testing.assert_array_equal(gpu, host)  # the same element functions, item by item
    tol = 1e-14 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(results[1][0], _activation(kind, x.astype(np.float64)), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("add", [False, True])
def test_scaled_entries_on_the_gpu_are_the_hosts(row_lib, dtype, add):
    rng = np.random.default_rng(2)
    scale, x, start = (rng.standard_normal(COUNT + 5).astype(dtype) for _ in range(3))
    for gpu in (0, 1):
        out = start.copy()
        if not add:
            out[:COUNT] = np.nan  # never read where it assigns
        run_rows(row_lib, "scale_entries", dtype, gpu, scale, x, out, int(add))
        expected = scale[:COUNT] * x[:COUNT] + (start[:COUNT] if add else 0)
        np.testing.assert_array_equal(out[:COUNT], expected)
        np.testing.assert_array_equal(out[COUNT:], start[COUNT:])


@pytest.mark.parametrize("curved", [False, True])
@pytest.mark.parametrize("add", [False, True])
def test_the_activations_cotangent_tangent_on_the_gpu_is_the_hosts(row_lib, curved, add):
    rng = np.random.default_rng(3)
    first, second, dg, g, dx, start = (rng.standard_normal(COUNT + 5) for _ in range(6))
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "activation_cotangent_tangent", np.float64, gpu, first, second if curved else None, dg, g,
                 dx, out, int(add))
        expected = first[:COUNT] * dg[:COUNT]
        if curved:
            expected = expected + second[:COUNT] * g[:COUNT] * dx[:COUNT]
        if add:
            expected = start[:COUNT] + expected
        np.testing.assert_array_equal(out[:COUNT], expected)
        np.testing.assert_array_equal(out[COUNT:], start[COUNT:])


# ---- products ---------------------------------------------------------------------------------------


class Operand:
    """A (rows, cols) operand inside a larger buffer: row- or column-major, `pad` spare entries per
    stride, `count` copies `step` entries apart (a batch)."""

    def __init__(self, rng, rows, cols, row_major, dtype, pad=0, count=1, step=None):
        self.rows, self.cols, self.row_major = rows, cols, row_major
        inner, outer = (cols, rows) if row_major else (rows, cols)
        self.stride = inner + pad
        self.step = self.stride * outer if step is None else step
        size = max(1, (count - 1) * self.step + self.stride * outer)
        self.buffer = rng.standard_normal(size).astype(dtype)

    def matrix(self, k=0) -> np.ndarray:
        flat = self.buffer[k * self.step:]
        if self.row_major:
            return np.lib.stride_tricks.as_strided(flat, (self.rows, self.cols), (self.stride * flat.itemsize, flat.itemsize))
        return np.lib.stride_tricks.as_strided(flat, (self.rows, self.cols), (flat.itemsize, self.stride * flat.itemsize))


def run(lib, gpu, C, A, B, count, alpha, accumulate, stream=0):
    fn = lib.product_f64 if C.buffer.dtype == np.float64 else lib.product_f32
    message = ctypes.create_string_buffer(512)
    step = C.step if count > 1 else 0
    status = fn(gpu, count, ptr(C.buffer), C.rows, C.cols, C.stride, step, ptr(A.buffer), A.cols, A.stride,
                int(A.row_major), A.step if count > 1 else 0, ptr(B.buffer), B.stride, int(B.row_major),
                B.step if count > 1 else 0, alpha, int(accumulate), stream, message, 512)
    return status, message.value.decode()


SHAPES = [(5, 4, 3), (1, 6, 2), (6, 1, 4), (3, 3, 1), (4, 5, 0), (7, 2, 9)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("a_row, b_row", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_a_product_matches_numpy_and_the_host_backend(lib, dtype, a_row, b_row, m, n, k, accumulate):
    rng = np.random.default_rng(m * 100 + n * 10 + k)
    A = Operand(rng, m, k, a_row, dtype, pad=2)
    B = Operand(rng, k, n, b_row, dtype, pad=1)
    results = {}
    for gpu in (0, 1):
        C = Operand(np.random.default_rng(5), m, n, True, dtype, pad=3)
        before = C.buffer.copy()
        if not accumulate:
            C.matrix()[...] = np.nan  # never read where the product assigns
        expected = 0.5 * (A.matrix().astype(np.float64) @ B.matrix().astype(np.float64))
        if accumulate:
            expected += C.matrix()
        status, message = run(lib, gpu, C, A, B, 1, 0.5, accumulate)
        assert status == 0, message
        tol = 1e-13 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(C.matrix(), expected, rtol=tol, atol=tol)
        outside = np.ones(C.buffer.shape, bool)
        outside[np.arange(m)[:, None] * C.stride + np.arange(n)] = False
        assert np.array_equal(C.buffer[outside], before[outside])  # the padding between rows untouched
        results[gpu] = C.matrix().copy()
    tol = 1e-14 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(results[1], results[0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("b_row", [True, False])
def test_a_batch_of_heads_inside_wider_arrays(lib, dtype, b_row):
    """The attention's shape: 3 heads of a sample, each (L, d_k) columns of a (L, 3 d_k) array, one
    step of d_k apart; the logits (L, L) one after another."""
    rng = np.random.default_rng(2)
    L, dk, heads = 5, 4, 3
    Q = Operand(rng, L, dk, True, dtype, pad=(heads - 1) * dk, count=heads, step=dk)
    K = Operand(rng, dk, L, b_row, dtype, pad=(heads - 1) * dk if not b_row else 0, count=heads,
                step=dk if not b_row else dk * L)
    for gpu in (0, 1):
        S = Operand(rng, L, L, True, dtype, count=heads)
        status, message = run(lib, gpu, S, Q, K, heads, 0.25, False)
        assert status == 0, message
        for i in range(heads):
            expected = 0.25 * (Q.matrix(i).astype(np.float64) @ K.matrix(i).astype(np.float64))
            tol = 1e-13 if dtype == np.float64 else 1e-5
            np.testing.assert_allclose(S.matrix(i), expected, rtol=tol, atol=tol)


def test_the_products_are_queued_on_the_backends_stream(lib):
    rng = np.random.default_rng(3)
    A, B, C = (Operand(rng, 3, 3, True, np.float64) for _ in range(3))
    assert run(lib, 1, C, A, B, 1, 1.0, False, stream=0x5eed)[0] == 0
    assert lib.cublas_standin_last_stream() == 0x5eed


def test_sizes_beyond_cublas_range_are_refused_before_any_memory_is_touched(lib):
    rng = np.random.default_rng(4)
    A = Operand(rng, 1, 1, True, np.float64)
    status, message = run(lib, 1, Operand(rng, 1, 1, True, np.float64), A, A, 1, 1.0, False)
    assert status == 0
    fn = lib.product_f64
    msg = ctypes.create_string_buffer(512)
    big = 1 << 31
    assert fn(1, 1, ptr(A.buffer), big, 1, 1, 0, ptr(A.buffer), 1, 1, 1, 0, ptr(A.buffer), 1, 1, 0, 1.0, 0, 0, msg,
              512) == 1
    assert "out of cuBLAS's range" in msg.value.decode()


MUTANTS = {
    "an operation flipped": ("row_major ? detail::kOpN : detail::kOpT", "row_major ? detail::kOpT : detail::kOpN"),
    "the operands not swapped": ("(handle_, b.op, a.op, ni, mi, ki, &alpha, B.data, b.ld, A.data, a.ld,",
                                 "(handle_, a.op, b.op, mi, ni, ki, &alpha, A.data, a.ld, B.data, b.ld,"),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_broken_backend_fails_here(lib, mutant):
    """The harness catches what it claims: each mutant gives a wrong product or a refused one."""
    old, new = MUTANTS[mutant]
    broken = _load(kernel_emulation.build_backend_probe(edits={old: new}))
    rng = np.random.default_rng(6)
    caught = 0
    for a_row, b_row in [(True, True), (True, False), (False, True), (False, False)]:
        A, B = Operand(rng, 5, 3, a_row, np.float64, pad=1), Operand(rng, 3, 4, b_row, np.float64, pad=2)
        C = Operand(rng, 5, 4, True, np.float64, pad=1)
        status, _ = run(broken, 1, C, A, B, 1, 1.0, False)
        caught += status != 0 or not np.allclose(C.matrix(), A.matrix() @ B.matrix())
    assert caught > 0
