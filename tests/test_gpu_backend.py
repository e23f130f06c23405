"""The GPU backend's products (cuda/src/backend.cu) on the CPU kernel emulator, with a stand-in for
the cuBLAS calls it makes (tests/cuda_emulator/cublas.cpp, which checks their arguments as cuBLAS
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
    return lib


@pytest.fixture(scope="module")
def lib():
    background_builds.result("kernel emulator", kernel_emulation.build_all)
    return _load(kernel_emulation.build_backend_probe())


def ptr(a: np.ndarray) -> P:
    return P(a.__array_interface__["data"][0])


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
