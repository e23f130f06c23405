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
    for name in ("zero", "activation_forward", "scale_entries", "activation_cotangent_tangent", "sum_entries", "write_entries",
                 "add_bias", "softmax_rows", "softmax_vjp_rows", "softmax_cotangent_tangent_rows",
                 "normalize_rows", "scale_columns", "norm_tangent_rows", "scale_by", "cross_entropy_tangent_rows", "norm_vjp_rows",
                 "norm_cotangent_tangent_rows", "column_sums", "mse_rows", "cross_entropy_rows", "class_token_rows",
                 "gather_rows", "scatter_rows", "sample_sums", "pooled_cross_entropy_rows", "pooled_block_entries",
                 "pooled_block_apply"):
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
    return _load(kernel_emulation.build_backend_probe(edits=kernel_emulation.SMALL_GRID))


def ptr(a: np.ndarray | None) -> P:
    return P(None if a is None else a.__array_interface__["data"][0])


# ---- row operations -------------------------------------------------------------------------------

COUNT = 1000  # more items than 3 blocks of 256 threads: the grid-stride loop goes round
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}


def run_rows(lib, name, dtype, *args, count=COUNT):
    fn = getattr(lib, name + ("_f64" if dtype == np.float64 else "_f32"))
    message = ctypes.create_string_buffer(512)
    # Integers as 64-bit: past the sixth argument they go on the stack, where a 32-bit int's upper half
    # is undefined (an int parameter reads the lower half of either).
    converted = [ptr(a) if a is None or isinstance(a, np.ndarray)
                 else ctypes.c_double(a) if isinstance(a, float) else ctypes.c_long(a) for a in args]
    assert fn(*converted, ctypes.c_long(count), message, ctypes.c_long(512)) == 0, message.value.decode()


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


@pytest.mark.parametrize("add", [False, True])
def test_entry_sums_writes_and_zeros_on_the_gpu_are_the_hosts(row_lib, add):
    rng = np.random.default_rng(4)
    a, b, start = (rng.standard_normal(COUNT + 5) for _ in range(3))
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "sum_entries", np.float64, gpu, a, b, out)
        np.testing.assert_array_equal(out, np.concatenate([a[:COUNT] + b[:COUNT], start[COUNT:]]))
        out = start.copy()
        run_rows(row_lib, "write_entries", np.float64, gpu, a, out, int(add))
        np.testing.assert_array_equal(out[:COUNT], start[:COUNT] + a[:COUNT] if add else a[:COUNT])
        np.testing.assert_array_equal(out[COUNT:], start[COUNT:])
        out = start.copy()
        run_rows(row_lib, "zero", np.float64, gpu, out)
        np.testing.assert_array_equal(out, np.concatenate([np.zeros(COUNT), start[COUNT:]]))


def test_a_bias_on_the_gpu_is_the_hosts(row_lib):
    rng = np.random.default_rng(5)
    width, tokens = 7, 150  # 1050 entries
    bias, start = rng.standard_normal(width), rng.standard_normal(tokens * width + 5)
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "add_bias", np.float64, gpu, bias, out, width, count=tokens * width)
        np.testing.assert_array_equal(out[:-5], (start[:-5].reshape(tokens, width) + bias).ravel())
        np.testing.assert_array_equal(out[-5:], start[-5:])


@pytest.mark.parametrize("times", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_sums_over_tokens_on_the_gpu_are_the_hosts(row_lib, times, accumulate):
    """A bias's gradient (the column sums of a cotangent) and gamma's (of its product with the
    normalised rows): 40 tokens of 1000 columns, a thread a column."""
    rng = np.random.default_rng(11)
    rows_, cols = 40, COUNT
    a, b = rng.standard_normal((rows_, cols)), rng.standard_normal((rows_, cols))
    start = rng.standard_normal(cols + 5)
    sums = []
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "column_sums", np.float64, gpu, a, b if times else None, out, rows_, cols, int(accumulate))
        np.testing.assert_array_equal(out[cols:], start[cols:])
        sums.append(out[:cols])
    np.testing.assert_array_equal(sums[1], sums[0])
    expected = (a * b if times else a).sum(axis=0) + (start[:cols] if accumulate else 0)
    np.testing.assert_allclose(sums[1], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("token", [False, True])
@pytest.mark.parametrize("rows", [False, True])
def test_a_class_tokens_rows_on_the_gpu_are_the_hosts(row_lib, add, token, rows):
    """Every sample's first row the token's (or 0), the others x's (or 0), assigned or added: a
    class token's forward pass, tangent and cotangent; 30 samples of 5 rows of 7."""
    rng = np.random.default_rng(12)
    samples, L, d = 30, 5, 7
    c, x = rng.standard_normal(d), rng.standard_normal(samples * L * d)
    start = rng.standard_normal(samples * L * d + 5)
    expected = (x if rows else np.zeros_like(x)).reshape(samples, L, d).copy()
    expected[:, 0, :] = c if token else 0
    expected = expected.ravel() + (start[:-5] if add else 0)
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "class_token_rows", np.float64, gpu, c if token else None, x if rows else None, out, int(add),
                 L * d, d, count=samples * L * d)
        np.testing.assert_array_equal(out[:-5], expected)
        np.testing.assert_array_equal(out[-5:], start[-5:])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_embeddings_lookup_and_its_scatter_on_the_gpu_are_the_hosts(row_lib, dtype):
    """Rows looked up by id (an embedding's forward pass and tangent), and every token's row added
    onto its id's row, each used row summing its tokens in token order (its gradient): 200 tokens
    of 7 over 40 rows of which some repeat and some are never used, against NumPy (the scatter:
    the same sums in the same order, bit for bit) and the host."""
    rng = np.random.default_rng(13)
    tokens, vocab, d = 200, 40, 7
    ids = rng.integers(0, 30, size=tokens)  # rows 30 to 39 are never looked up
    table = rng.standard_normal((vocab, d)).astype(dtype)
    for gpu in (0, 1):
        out = np.full(tokens * d + 5, np.nan, dtype)
        run_rows(row_lib, "gather_rows", dtype, gpu, table, ids, out, d, count=tokens * d)
        np.testing.assert_array_equal(out[:-5], table[ids].ravel())
        assert np.isnan(out[-5:]).all()

    rows = rng.standard_normal((tokens, d)).astype(dtype)
    order = np.argsort(ids, kind="stable")
    used, starts = np.unique(ids[order], return_index=True)
    starts = np.append(starts, tokens)
    expected = table.copy()
    for t in range(tokens):  # the host's loop before the row operation: token after token
        expected[ids[t]] += rows[t]
    for gpu in (0, 1):
        out = np.append(table.ravel(), np.full(5, np.nan, dtype))
        run_rows(row_lib, "scatter_rows", dtype, gpu, rows, used, starts, order, out, d, count=len(used) * d)
        np.testing.assert_array_equal(out[:-5], expected.ravel())
        assert np.isnan(out[-5:]).all()


def _softmax(logits, causal):
    """Row softmax from its definition, float64; causal: row r of each (L, L) block sees k <= r."""
    L = logits.shape[-1]
    z = logits.copy()
    if causal:
        z[..., ~np.tril(np.ones((L, L), bool))] = -np.inf
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_the_attention_softmax_rows_on_the_gpu_are_the_hosts(row_lib, dtype, causal):
    """The weights' rows of 2 samples x 3 heads x (L, L), L = 13: 78 rows, more than 3 blocks' worth
    once the grid is cut (a thread a row)."""
    rng = np.random.default_rng(6)
    L, blocks = 13, 6
    logits = (3 * rng.standard_normal((blocks, L, L))).astype(dtype)
    weights = []
    for gpu in (0, 1):
        a = np.concatenate([logits.ravel(), np.full(5, 7.0, dtype)])
        run_rows(row_lib, "softmax_rows", dtype, gpu, a, L, int(causal), count=blocks * L)
        assert (a[-5:] == 7.0).all()
        weights.append(a[:-5].reshape(blocks, L, L))
    np.testing.assert_array_equal(weights[1], weights[0])
    tol = 1e-14 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(weights[1], _softmax(logits.astype(np.float64), causal), rtol=tol, atol=tol)

    g = rng.standard_normal((blocks, L, L)).astype(dtype)
    cotangents = []
    for gpu in (0, 1):
        gt = np.full(blocks * L * L + 5, np.nan, dtype)
        run_rows(row_lib, "softmax_vjp_rows", dtype, gpu, weights[0].ravel().copy(), g.ravel().copy(), gt, L,
                 count=blocks * L)
        assert np.isnan(gt[-5:]).all()
        cotangents.append(gt[:-5].reshape(blocks, L, L))
    np.testing.assert_array_equal(cotangents[1], cotangents[0])
    a = weights[0].astype(np.float64)
    expected = a * (g - (a * g).sum(axis=-1, keepdims=True))  # J^T g of each row, J = diag(a) - a a^T
    np.testing.assert_allclose(cotangents[1], expected, rtol=tol * 10, atol=tol * 10)

    # The tangent of J^T g as the weights move by da = J dt and g by dg.
    dt, dg = (rng.standard_normal((blocks, L, L)).astype(dtype) for _ in range(2))
    if causal:
        dt[..., ~np.tril(np.ones((L, L), bool))] = 0  # the masked logits never move
    da = (a * (dt - (a * dt).sum(axis=-1, keepdims=True))).astype(dtype)
    tangents = []
    for gpu in (0, 1):
        dgt = np.full(blocks * L * L + 5, np.nan, dtype)
        run_rows(row_lib, "softmax_cotangent_tangent_rows", dtype, gpu, weights[0].ravel().copy(), da.ravel().copy(),
                 g.ravel().copy(), dg.ravel().copy(), dgt, L, count=blocks * L)
        assert np.isnan(dgt[-5:]).all()
        tangents.append(dgt[:-5].reshape(blocks, L, L))
    np.testing.assert_array_equal(tangents[1], tangents[0])
    # d[a * (g - a.g)] by the product rule, from the definition
    da64, g64, dg64 = (x.astype(np.float64) for x in (da, g, dg))
    ag = (a * g64).sum(axis=-1, keepdims=True)
    expected = da64 * (g64 - ag) + a * (dg64 - (da64 * g64).sum(axis=-1, keepdims=True) - (a * dg64).sum(axis=-1, keepdims=True))
    np.testing.assert_allclose(tangents[1], expected, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True])
def test_the_norms_rows_and_their_tangents_on_the_gpu_are_the_hosts(row_lib, dtype, norm, affine):
    """A norm node's rows, its scale by gamma and the tangent of its output (a Hessian-vector
    product's forward pass): 90 tokens of width 11, so the scale's 990 entries outnumber 3 blocks'
    768 threads and its grid-stride loop goes round."""
    rng = np.random.default_rng(7)
    tokens, d, eps, rms = 90, 11, 1e-5, int(norm == "rmsnorm")
    u = (2 * rng.standard_normal((tokens, d)) + 0.5).astype(dtype)
    gamma, dgamma, dbeta = (rng.standard_normal(d).astype(dtype) for _ in range(3))
    du = rng.standard_normal((tokens, d)).astype(dtype)
    results = []
    for gpu in (0, 1):
        n, scale = np.full(tokens * d + 5, np.nan, dtype), np.full(tokens + 5, np.nan, dtype)
        run_rows(row_lib, "normalize_rows", dtype, gpu, u, n, scale, d, eps, rms, count=tokens)
        assert np.isnan(n[-5:]).all() and np.isnan(scale[-5:]).all()
        y = np.full(tokens * d, np.nan, dtype)
        run_rows(row_lib, "scale_columns", dtype, gpu, n, gamma, y, d, count=tokens * d)
        dn, dy = np.full(tokens * d, np.nan, dtype), np.full(tokens * d, np.nan, dtype)
        run_rows(row_lib, "norm_tangent_rows", dtype, gpu, n, scale, du, gamma if affine else None,
                 dgamma if affine else None, dbeta if affine else None, dn, dy if affine else dn, d, rms,
                 count=tokens)
        results.append([n[:-5].reshape(tokens, d), scale[:-5], y.reshape(tokens, d), dn.reshape(tokens, d),
                        dy.reshape(tokens, d)])
    for host, gpu in zip(*results):
        np.testing.assert_array_equal(gpu, host)
    # Against the definitions, float64.
    u64, du64 = u.astype(np.float64), du.astype(np.float64)
    if rms:
        r = np.sqrt((u64**2).mean(axis=1, keepdims=True) + eps)
        n_ref = u64 / r
        dn_ref = (du64 - n_ref * (n_ref * du64).mean(axis=1, keepdims=True)) / r
    else:
        r = np.sqrt(u64.var(axis=1, keepdims=True) + eps)
        n_ref = (u64 - u64.mean(axis=1, keepdims=True)) / r
        dn_ref = (du64 - du64.mean(axis=1, keepdims=True) - n_ref * (n_ref * du64).mean(axis=1, keepdims=True)) / r
    n, scale, y, dn, dy = results[1]
    tol = 1e-13 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(n, n_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(scale, r[:, 0], rtol=tol)
    np.testing.assert_allclose(y, n_ref * gamma, rtol=tol, atol=tol)
    np.testing.assert_allclose(dn, dn_ref, rtol=tol * 10, atol=tol * 10)
    if affine:
        np.testing.assert_allclose(dy, gamma * dn_ref + n_ref * dgamma + dbeta, rtol=tol * 10, atol=tol * 10)


def _norm_rows(u, rms, eps):
    """(n, scale) of each row from the definition, float64."""
    if rms:
        r = np.sqrt((u**2).mean(axis=-1, keepdims=True) + eps)
        return u / r, r
    r = np.sqrt(u.var(axis=-1, keepdims=True) + eps)
    return (u - u.mean(axis=-1, keepdims=True)) / r, r


def _norm_vjp(u, g, rms, eps):
    """J0(u)^T g of each row, from the definition (J0 symmetric)."""
    n, r = _norm_rows(u, rms, eps)
    if rms:
        return (g - n * (n * g).mean(axis=-1, keepdims=True)) / r
    return (g - g.mean(axis=-1, keepdims=True) - n * (n * g).mean(axis=-1, keepdims=True)) / r


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("curved", [False, True])
def test_the_norms_reverse_pass_and_its_tangent_on_the_gpu_are_the_hosts(row_lib, norm, affine, add, curved):
    """A norm node's input cotangent J0^T (gamma gy), and in a Hessian-vector product its tangent
    J0^T (gamma dgy + dgamma gy) + (curved) dJ0^T (gamma gy), each with five or two rows of scratch
    (one a thread on the host, one an item on the GPU), assigned or added; the tangent checked
    against central differences of the definition's vjp (float64, step 1e-5)."""
    rng = np.random.default_rng(10)
    tokens, d, eps, rms = 90, 11, 1e-5, int(norm == "rmsnorm")
    u = 2 * rng.standard_normal((tokens, d)) + 0.5
    gy, dgy, du = (rng.standard_normal((tokens, d)) for _ in range(3))
    gamma, dgamma = (rng.standard_normal(d) for _ in range(2))
    n, r = _norm_rows(u, rms, eps)
    dn = _norm_vjp(u, du, rms, eps)  # J0 du (J0 symmetric)
    start = rng.standard_normal((tokens, d))
    vjps, tangents = [], []
    for gpu in (0, 1):
        out = start.copy()
        run_rows(row_lib, "norm_vjp_rows", np.float64, gpu, n, r[:, 0].copy(), gy, gamma if affine else None, out,
                 int(add), d, rms, count=tokens)
        vjps.append(out)
        out = start.copy()
        run_rows(row_lib, "norm_cotangent_tangent_rows", np.float64, gpu, n, r[:, 0].copy(), gy, dgy,
                 gamma if affine else None, dgamma if affine else None, du, dn, out, int(add), int(curved), d, rms,
                 count=tokens)
        tangents.append(out)
    np.testing.assert_array_equal(vjps[1], vjps[0])
    np.testing.assert_array_equal(tangents[1], tangents[0])
    base = start if add else 0
    g_hat = gamma * gy if affine else gy
    np.testing.assert_allclose(vjps[1] - base, _norm_vjp(u, g_hat, rms, eps), rtol=1e-12, atol=1e-12)
    if curved:
        h = 1e-5
        gam = (lambda s: gamma + s * dgamma) if affine else (lambda s: 1.0)
        moved = [_norm_vjp(u + s * du, gam(s) * (gy + s * dgy), rms, eps) for s in (h, -h)]
        expected = (moved[0] - moved[1]) / (2 * h)
        np.testing.assert_allclose(tangents[1] - base, expected, rtol=1e-7, atol=1e-7)
    else:
        np.testing.assert_allclose(tangents[1] - base, _norm_vjp(u, gamma * dgy if affine else dgy, rms, eps),
                                   rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_losses_second_derivatives_on_a_tangent_on_the_gpu_are_the_hosts(row_lib, dtype):
    """The Hessian-vector product's seed: mse's 2/(B L d) dz, and cross-entropy's
    1/(B L) (diag p - p p^T) dz per token (100 tokens of 10 logits: 1000 entries)."""
    rng = np.random.default_rng(9)
    tokens, d, scale = 100, 10, 1 / 100
    dz = rng.standard_normal(tokens * d).astype(dtype)
    logits = rng.standard_normal((tokens, d))
    p = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(dtype)
    scaled, tangents = [], []
    for gpu in (0, 1):
        out = np.full(tokens * d + 5, np.nan, dtype)
        run_rows(row_lib, "scale_by", dtype, gpu, 0.25, dz, out, count=tokens * d)
        assert np.isnan(out[-5:]).all()
        scaled.append(out[:-5])
        out = np.full(tokens * d + 5, np.nan, dtype)
        run_rows(row_lib, "cross_entropy_tangent_rows", dtype, gpu, p, dz, out, d, scale, count=tokens)
        assert np.isnan(out[-5:]).all()
        tangents.append(out[:-5].reshape(tokens, d))
    np.testing.assert_array_equal(scaled[1], scaled[0])
    np.testing.assert_array_equal(scaled[1], (dtype(0.25) * dz))
    np.testing.assert_array_equal(tangents[1], tangents[0])
    p64, dz64 = p.astype(np.float64), dz.reshape(tokens, d).astype(np.float64)
    expected = np.einsum("tab,tb->ta", scale * (np.einsum("ta,ab->tab", p64, np.eye(d)) - np.einsum("ta,tb->tab", p64, p64)),
                         dz64)
    tol = 1e-14 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(tangents[1], expected, rtol=tol * 10, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_losses_rows_on_the_gpu_are_the_hosts(row_lib, dtype):
    """The losses and their gradients, a token a thread (the loss is their row sums, summed in
    order afterwards): mse against a target; cross-entropy against classes, with a token ignored
    (-100: no loss, no gradient, p = 0)."""
    rng = np.random.default_rng(14)
    tokens, d, scale = 333, 4, 0.125
    z, target = (rng.standard_normal(tokens * d + 5).astype(dtype) for _ in range(2))
    classes = rng.integers(0, d, size=tokens + 5).astype(np.int64)
    classes[7] = -100
    mse, ce = [], []
    for gpu in (0, 1):
        gz, rows_ = np.full(tokens * d + 5, np.nan, dtype), np.full(tokens + 5, np.nan, dtype)
        run_rows(row_lib, "mse_rows", dtype, gpu, z, target, gz, rows_, d, scale, count=tokens)
        assert np.isnan(gz[-5:]).all() and np.isnan(rows_[-5:]).all()
        mse.append((gz[:-5], rows_[:-5]))
        p, gz, rows_ = (np.full(n + 5, np.nan, dtype) for n in (tokens * d, tokens * d, tokens))
        run_rows(row_lib, "cross_entropy_rows", dtype, gpu, z, classes, p, gz, rows_, d, scale, 1, count=tokens)
        assert np.isnan(p[-5:]).all() and np.isnan(gz[-5:]).all() and np.isnan(rows_[-5:]).all()
        ce.append((p[:-5], gz[:-5], rows_[:-5]))
    for host, gpu in zip(mse[0] + ce[0], mse[1] + ce[1]):
        np.testing.assert_array_equal(gpu, host)
    tol = 1e-14 if dtype == np.float64 else 1e-6
    r = (z[:-5] - target[:-5]).astype(np.float64).reshape(tokens, d)
    np.testing.assert_allclose(mse[1][0], (2 * scale * r).ravel(), rtol=tol, atol=tol)
    np.testing.assert_allclose(mse[1][1], scale * (r * r).sum(axis=1), rtol=10 * tol, atol=tol)
    logits, k = z[:-5].astype(np.float64).reshape(tokens, d), np.maximum(classes[:tokens], 0)
    top = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - top) / np.exp(logits - top).sum(axis=1, keepdims=True)
    loss = scale * (np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0] - logits[np.arange(tokens), k])
    grad = scale * (p - np.eye(d)[k])
    p[7], grad[7], loss[7] = 0, 0, 0  # the ignored token (its class read as 0 above)
    np.testing.assert_allclose(ce[1][0], p.ravel(), rtol=10 * tol, atol=tol)
    np.testing.assert_allclose(ce[1][1], grad.ravel(), rtol=10 * tol, atol=tol)
    np.testing.assert_allclose(ce[1][2], loss, rtol=10 * tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("head", [False, True])
def test_the_pooled_cross_entropys_rows_on_the_gpu_are_the_hosts(row_lib, dtype, head):
    """The pooled mean's cross-entropy (a sample a thread: its mean, logits, p, loss, gradient rows
    and W_C p), its (d, d) blocks (an entry a thread, exactly symmetric), a tangent's sample sums
    and the blocks applied to them: 40 samples of 4 rows of 5, 3 classes through a head (W_C, b_C)
    or (no head) 5 classes, the rows' own logits; against the host and NumPy."""
    rng = np.random.default_rng(15)
    B, L, d = 40, 4, 5
    C = 3 if head else d
    z, dz = (rng.standard_normal(B * L * d).astype(dtype) for _ in range(2))
    W, b = (rng.standard_normal((d, C)).astype(dtype), rng.standard_normal(C).astype(dtype)) if head else (None, None)
    classes = rng.integers(0, C, size=B)
    results = []
    for gpu in (0, 1):
        p, wp, gz, loss = (np.full(n + 5, np.nan, dtype) for n in (B * C, B * d, B * L * d, B))
        run_rows(row_lib, "pooled_cross_entropy_rows", dtype, gpu, z, classes, W, b, p, wp, gz, loss, L, d, C,
                 1.0 / B, 1.0 / L, count=B)
        G = np.full(B * d * d + 5, np.nan, dtype)
        run_rows(row_lib, "pooled_block_entries", dtype, gpu, p, wp, W, G, d, C, 1.0 / (B * L * L), count=B * d * d)
        sums, out = np.full(B * d + 5, np.nan, dtype), np.full(B * L * d + 5, np.nan, dtype)
        run_rows(row_lib, "sample_sums", dtype, gpu, dz, sums, L, d, count=B * d)
        run_rows(row_lib, "pooled_block_apply", dtype, gpu, G, sums, out, L, d, count=B * L * d)
        arrays = (p, wp, gz, loss, G, sums, out)
        assert all(np.isnan(a[-5:]).all() for a in arrays)
        results.append([a[:-5] for a in arrays])
    for host, gpu in zip(*results):
        np.testing.assert_array_equal(gpu, host)
    p, wp, gz, loss, G, sums, out = results[1]
    Wd = np.eye(d) if W is None else W.astype(np.float64)
    m = z.astype(np.float64).reshape(B, L, d).mean(axis=1)
    logits = m @ Wd + (0 if b is None else b)
    top = logits.max(axis=1, keepdims=True)
    P = np.exp(logits - top) / np.exp(logits - top).sum(axis=1, keepdims=True)
    onehot = np.eye(C)[classes]
    blocks = np.einsum("ac,bc,ec->bae", Wd, P, Wd) - np.einsum("ac,bc,ed,bd->bae", Wd, P, Wd, P)
    S = dz.astype(np.float64).reshape(B, L, d).sum(axis=1)
    tol = 1e-13 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(p, P.ravel(), rtol=tol, atol=tol)
    np.testing.assert_allclose(wp, (P @ Wd.T).ravel(), rtol=tol, atol=tol)
    np.testing.assert_allclose(gz.reshape(B, L, d), np.repeat(((P - onehot) @ Wd.T / (B * L))[:, None], L, axis=1),
                               rtol=tol, atol=tol)
    np.testing.assert_allclose(loss, (np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
                                      - logits[np.arange(B), classes]) / B, rtol=tol, atol=tol)
    G = G.reshape(B, d, d)
    np.testing.assert_array_equal(G, G.transpose(0, 2, 1))
    np.testing.assert_allclose(G, blocks / (B * L * L), rtol=tol, atol=tol)
    np.testing.assert_allclose(sums, S.ravel(), rtol=tol, atol=tol)
    np.testing.assert_allclose(out.reshape(B, L, d), np.repeat(np.einsum("bae,be->ba", G, S)[:, None], L, axis=1),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_finiteness_check_on_the_gpu_finds_every_inf_and_nan(row_lib, dtype):
    """The passes' checks: an Inf or NaN anywhere among 1000 values (the last one too, which a
    3-block grid reaches only on its second round), never one just past the end."""
    fn = getattr(row_lib, "all_finite" + ("_f64" if dtype == np.float64 else "_f32"))

    def finite(gpu, values, count=COUNT):
        flag = ctypes.c_int(-1)
        assert fn(gpu, ptr(values), ctypes.c_long(count), ctypes.byref(flag)) == 0
        return flag.value

    values = np.random.default_rng(8).standard_normal(COUNT + 1).astype(dtype)
    values[COUNT] = np.nan  # past the end: never read
    assert finite(0, values) == finite(1, values) == 1
    for where in (0, 500, COUNT - 1):
        for bad in (np.inf, -np.inf, np.nan):
            spoiled = values.copy()
            spoiled[where] = bad
            assert finite(0, spoiled) == finite(1, spoiled) == 0, (where, bad)
    assert finite(1, values, count=0) == 1


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
