"""The engine end to end on the GPU backend (cuda/src/backend.cu), on the CPU kernel emulator: the
loss, its gradient and Hessian-vector products of blocks of the family (the paper's, a GPT-2-like
pre-LN block with biases, causal heads and W_O, a post-RMSNorm SiLU block, an attention-only block),
of a ViT (patch embedding, class token, learned positions, two blocks, final norm, classifier; its
class token's cross-entropy too, and without the class token the pooled mean's) and of a GPT-2-like
language model (token embedding with repeated ids, learned positions, two blocks, final norm, tied
LM head; the next-token loss with an ignored label), each loss and part, in float64 and float32,
against the same engine on the host backend.

The emulator's device memory is pages the host cannot touch outside device work
(tests/cuda_emulator/cuda_runtime.h), so a node that reads or writes the GPU's memory from the host
faults: the cases run in a process of their own (tests/cuda_emulator/engine_cases.py), and a fault
there fails every test here with what the process said.

On a GPU machine the same passes run on the real cuBLAS and kernels (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import background_builds
import kernel_emulation
import numpy as np
import pytest

pytestmark = kernel_emulation.needs_emulator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "cuda_emulator"))
import engine_cases  # noqa: E402


@pytest.fixture(scope="module")
def library() -> Path:
    background_builds.result("kernel emulator", kernel_emulation.build_all)
    return kernel_emulation.build_backend_probe()


@pytest.fixture(scope="module")
def results(library, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-engine") / "results.npz"
    done = subprocess.run([sys.executable, str(HERE / "cuda_emulator" / "engine_cases.py"), str(library), str(out)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, (f"the engine cases ended with status {done.returncode} (a negative status is a "
                                  f"signal: SIGSEGV where host code touched the GPU's memory)\n{done.stderr[-4000:]}")
    return np.load(out)


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), np.finfo(b.dtype).tiny))


@pytest.mark.parametrize("case", engine_cases.CASES, ids=lambda c: engine_cases.name(*c))
def test_the_engine_on_the_gpu_backend_is_the_hosts(results, case):
    """The same passes on the two backends differ only in the products' summation order (cuBLAS
    against the host's blocked products): 1e-12 in float64, 1e-5 in float32."""
    name = engine_cases.name(*case)
    tol = 1e-12 if case[-1] == "f64" else 1e-5
    for what in ("value", "grad", "hv"):
        host, gpu = results[f"{name}/host/{what}"], results[f"{name}/gpu/{what}"]
        assert np.isfinite(gpu).all() and np.abs(gpu).max() > 0, what  # written, and not trivially
        assert _relative(gpu, host) < tol, (what, _relative(gpu, host))


@pytest.mark.parametrize("case", engine_cases.CASES, ids=lambda c: engine_cases.name(*c))
def test_the_probe_wires_the_block_the_public_functions_do(results, case):
    """The probe's host run is blockhess's own loss_gradient, loss_hvp and operator value (tested
    against autograd elsewhere), up to the two builds' compiler flags: the cases above test the
    blocks they claim to."""
    name = engine_cases.name(*case)
    tol = 1e-13 if case[-1] == "f64" else 1e-5
    for what in ("value", "grad", "hv"):
        assert _relative(results[f"{name}/host/{what}"], results[f"{name}/public/{what}"]) < tol, what


@pytest.mark.parametrize("dtype", list(engine_cases.DTYPES))
@pytest.mark.parametrize("case", [c[2] for c in engine_cases.FFN_CASES])
def test_the_ffn_sublayer_on_the_gpu_backend_is_the_hosts(results, case, dtype):
    """The FFN's output, Jacobians (its parameters' from their tangent factors pushed through the
    linear maps and the ReLU on the GPU backend; the input's by forward tangents), Kronecker
    factors and cross second derivative, on the GPU backend with device memory closed to the host:
    the host's to rounding (the products' order), and the host's are the public functions'. The
    cross derivative's values are single products, the same bits on both."""
    name = engine_cases.ffn_name(case, dtype)
    host, gpu, public = (results[f"{name}/{where}"] for where in ("host", "gpu", "public"))
    assert np.isfinite(gpu).all() and np.abs(gpu).max() > 0
    tol = 1e-12 if dtype == "f64" else 1e-5
    assert _relative(gpu, host) < tol and _relative(host, public) < tol
    if case.startswith("cross"):
        np.testing.assert_array_equal(gpu, host)


@pytest.mark.parametrize("dtype", list(engine_cases.DTYPES))
@pytest.mark.parametrize("case", [c[2] for c in engine_cases.ATTENTION_CASES])
def test_the_attention_on_the_gpu_backend_is_the_hosts(results, case, dtype):
    """The attention's output and its Jacobians (its parameters' from the factors its push forms on
    the GPU backend; its input's closed form, one row operation) with device memory closed to the
    host: the host's to rounding, and the host's are the public functions'."""
    name = engine_cases.attention_name(case, dtype)
    host, gpu, public = (results[f"{name}/{where}"] for where in ("host", "gpu", "public"))
    assert np.isfinite(gpu).all() and np.abs(gpu).max() > 0
    tol = 1e-12 if dtype == "f64" else 1e-5
    assert _relative(gpu, host) < tol and _relative(host, public) < tol


@pytest.mark.parametrize("spec,name,dtype", [(*key, dtype) for key in engine_cases.jacobian_keys()
                                             for dtype in engine_cases.DTYPES], ids=lambda *a: "-".join(map(str, a)))
def test_a_blocks_or_models_jacobian_runs_on_the_gpu_backend(results, spec, name, dtype):
    """dZ/dW of a block or a language model on the GPU backend, device memory closed to the host:
    the factors formed by the attention and pushed through the linear maps, the activation, the
    residual sums, the norms and the LM head there, equal to the host's to rounding (and the
    host's are blockhess.block_jacobian's). A moving input's factors (a pre-LN block's first
    norm's; a lower layer's norm and biases, b_Q's right factor and all) are mixed by the
    attention there too (its mix()); where no attention can mix them (a lower layer's weight, the
    positions, the tied embedding) a forward tangent per entry runs there, one after another."""
    key = f"jacobian-{spec}-{name}-{dtype}"
    host, gpu, public = (results[f"{key}/{where}"] for where in ("host", "gpu", "public"))
    tol = 1e-12 if dtype == "f64" else 1e-5
    assert _relative(host, public) < tol
    assert gpu.shape == host.shape and np.isfinite(gpu).all()
    if name == "b_K":  # moves every logit of a row alike, which softmax ignores: exactly 0
        assert not gpu.any() and not host.any()
        return
    assert np.abs(gpu).max() > 0 and _relative(gpu, host) < tol


def test_the_hessian_vector_product_moves_with_its_part(results):
    """The full product is the outer plus the functional one, on the GPU as on the host (the parts
    are not all the same product)."""
    for spec in engine_cases.SPECS:
        for loss in engine_cases.OWN_LOSSES.get(spec, engine_cases.LOSSES):
            hv = {part: results[f"{engine_cases.name(spec, loss, part, 'f64')}/gpu/hv"] for part in engine_cases.PARTS}
            np.testing.assert_allclose(hv["full"], hv["outer"] + hv["functional"], rtol=1e-12, atol=1e-13)
            assert _relative(hv["outer"], hv["full"]) > 1e-6


def test_host_code_touching_the_gpus_memory_faults_on_the_emulator(library):
    """What makes the cases above mean something: a host write into the GPU backend's memory
    faults (a SIGSEGV) instead of passing as it would on plain host memory."""
    code = f"import ctypes; ctypes.CDLL({str(library)!r}).host_writes_gpu_memory(); print('not caught')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -11 and "not caught" not in done.stdout, (done.returncode, done.stdout, done.stderr)


def test_what_still_runs_on_the_host_refuses_the_gpu_backend(library):
    """The curvature's terms still run on the host: on the GPU backend they refuse with a clear
    error that says what runs there (docs/backends.md), never read device memory; the factors
    pushed before them (a norm's, mixed by an attention) run there."""
    lib = ctypes.CDLL(str(library))
    message = ctypes.create_string_buffer(512)
    assert lib.gpu_graph_refuses_curvature(message, ctypes.c_long(512)) == 1
    text = message.value.decode()
    assert text.startswith("engine: " + engine_cases.REFUSED), text
    assert "Hessian-vector products" in text and "linear and pointwise maps" in text, text
