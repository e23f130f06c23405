"""The GPU code path (blockhess._gpu + blockhess._gpu_launch) run on NumPy arrays, against the CPU core.

Each test runs three times, with the kernel launches going to the real kernels of cuda/src and the
real bindings (src/cuda_module.cpp, src/cuda_block.cpp: the engine with its GPU assembly target)
compiled for the CPU (tests/kernel_emulation.py), every CUDA thread a fiber, barriers and warp
shuffles emulated and checked, launch geometry as on the GPU:
- ``cpu-kernels``: as they are;
- ``cpu-kernels-reverse`` and ``cpu-kernels-warp-ahead``: at most 3 blocks per grid row (every
  grid-stride loop goes round) and threads run in other orders between barriers, so that a missing
  barrier or a race changes the result (tests/test_kernel_emulator.py shows each mode catching a
  planted defect).
What only a GPU can show (the compiled device code, timings, streams) is left to tests/test_cuda.py.
"""

import cupy_emulation
import kernel_emulation
import numpy as np
import pytest

import blockhess
from blockhess import _gpu

pytestmark = kernel_emulation.needs_emulator


@pytest.fixture(params=["cpu-kernels", "cpu-kernels-reverse", "cpu-kernels-warp-ahead"])
def kernels(request, monkeypatch):
    if request.param == "cpu-kernels":
        return kernel_emulation.install(monkeypatch, request.getfixturevalue("cpu_kernels"))  # tests/conftest.py
    monkeypatch.setenv("BLOCKHESS_EMULATOR_SCHEDULE", request.param.removeprefix("cpu-kernels-"))
    return kernel_emulation.install(monkeypatch, request.getfixturevalue("cpu_kernels_small_grid"))


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


TOL = 1e-12


@pytest.mark.parametrize("L,d", [(1, 2), (3, 5), (6, 4)])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", [False, True])
def test_layernorm(kernels, rng, L, d, eps, affine):
    X = rng.standard_normal((L, d)) + 0.2
    gamma = rng.standard_normal(d) if affine else None
    beta = rng.standard_normal(d) if affine else None
    G = rng.standard_normal((L, d))
    scale = 1.0 if d == 2 else 1e-300
    r = lambda a, b: np.linalg.norm(a - b) / max(np.linalg.norm(b), scale)  # noqa: E731
    assert r(_gpu.layernorm(X, eps, gamma, beta), blockhess.layernorm(X, eps, gamma, beta)) <= TOL
    for layout in ("dense", "blocks"):
        assert r(_gpu.layernorm_jacobian(X, eps, gamma, layout, "X"),
                 blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma, layout=layout)) <= TOL
        assert r(_gpu.layernorm_hessian(X, eps, gamma, layout),
                 blockhess.layernorm_hessian(X, eps=eps, gamma=gamma, layout=layout)) <= TOL
    for wrt in ("gamma", "beta"):
        got = _gpu.layernorm_jacobian(X, eps, gamma, "dense", wrt)  # block reductions: equal up to rounding
        assert r(got, blockhess.layernorm_jacobian(X, eps=eps, gamma=gamma, wrt=wrt)) <= TOL
    assert r(_gpu.layernorm_hessian_contract(X, G, eps, gamma),
             blockhess.layernorm_hessian_contract(X, G, eps=eps, gamma=gamma)) <= TOL
    assert {"layernorm_forward", "layernorm_jacobian_dense", "layernorm_jacobian_blocks", "layernorm_hessian_dense",
            "layernorm_hessian_blocks", "layernorm_hessian_contract"} <= set(kernels.calls)


def test_layernorm_zero_variance_message_matches_cpu(kernels):
    X = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])
    with pytest.raises(ValueError) as cpu:
        blockhess.layernorm_jacobian(X)
    for call in (lambda: _gpu.layernorm(X, 0.0, None, None),
                 lambda: _gpu.layernorm_jacobian(X, 0.0, None, "blocks", "X"),
                 lambda: _gpu.layernorm_hessian(X, 0.0, None, "dense"),
                 lambda: _gpu.layernorm_hessian_contract(X, X, 0.0, None)):
        with pytest.raises(ValueError) as gpu:
            call()
        assert str(gpu.value) == str(cpu.value)
    assert np.isfinite(_gpu.layernorm_jacobian(X, 1e-5, None, "blocks", "X")).all()


@pytest.mark.parametrize("m,n", [(1, 1), (3, 3), (2, 5), (4, 3)])
def test_softmax(kernels, rng, m, n):
    T = rng.standard_normal((m, n)) * 2
    assert rel(_gpu.softmax(T), blockhess.softmax(T)) <= TOL
    for layout in ("dense", "blocks"):
        assert rel(_gpu.softmax_jacobian(T, layout), blockhess.softmax_jacobian(T, layout=layout)) <= TOL
        assert rel(_gpu.softmax_hessian(T, layout), blockhess.softmax_hessian(T, layout=layout)) <= TOL


@pytest.mark.parametrize("rows,n", [(4, 70), (2, 300)])
def test_rows_longer_than_a_warp(kernels, rng, rows, n):
    """Row kernels whose rows span several warps (block reductions across warps) or more than one
    block of threads (strided loops), LayerNorm and softmax, against the CPU core and NumPy."""
    from blockhess import _gpu_launch

    X = rng.standard_normal((rows, n)) * 1.5 + 0.3
    gamma, G = rng.standard_normal(n), rng.standard_normal((rows, n))
    assert rel(_gpu.layernorm(X, 1e-3, gamma, gamma), blockhess.layernorm(X, 1e-3, gamma, gamma)) <= TOL
    assert rel(_gpu.layernorm_jacobian(X, 1e-3, gamma, "blocks", "X"),
               blockhess.layernorm_jacobian(X, eps=1e-3, gamma=gamma, layout="blocks")) <= TOL
    assert rel(_gpu.layernorm_hessian_contract(X, G, 1e-3, gamma),
               blockhess.layernorm_hessian_contract(X, G, eps=1e-3, gamma=gamma)) <= TOL
    A = _gpu.softmax(X)
    assert rel(A, blockhess.softmax(X)) <= TOL
    assert rel(_gpu.softmax_jacobian(X, "blocks"), blockhess.softmax_jacobian(X, layout="blocks")) <= TOL
    if n <= 70:
        assert rel(_gpu.layernorm_hessian(X, 1e-3, gamma, "blocks"),
                   blockhess.layernorm_hessian(X, eps=1e-3, gamma=gamma, layout="blocks")) <= TOL
        assert rel(_gpu.softmax_hessian(X, "blocks"), blockhess.softmax_hessian(X, layout="blocks")) <= TOL
    w = A * (G - (A * G).sum(axis=1, keepdims=True))
    vjp, contract = np.empty_like(A), np.empty((rows, n, n))
    _gpu_launch.softmax_vjp(A, G, vjp)
    _gpu_launch.softmax_hessian_contract(A, G, contract)
    assert rel(vjp, w) <= TOL
    want = np.eye(n) * w[:, None, :] - A[:, :, None] * w[:, None, :] - w[:, :, None] * A[:, None, :]
    assert rel(contract, want) <= TOL


def test_commutation(kernels, rng):
    A = rng.standard_normal((3, 5))
    v = blockhess.vec_r(A)
    np.testing.assert_array_equal(_gpu.vec_r(A), v)
    np.testing.assert_array_equal(_gpu.unvec_r(v, 3, 5), A)
    np.testing.assert_array_equal(_gpu.commute(v, 3, 5), blockhess.commute(v, 3, 5))
    M = rng.standard_normal((15, 4))
    np.testing.assert_array_equal(_gpu.commute(M, 5, 3), blockhess.commute(M, 5, 3))
    np.testing.assert_array_equal(_gpu.commutation_matrix(3, 5, np.float64, A), blockhess.commutation_matrix(3, 5))
    B, X = rng.standard_normal((2, 4)), rng.standard_normal((5, 4))
    assert rel(_gpu.kron_apply(A, B, X), blockhess.kron_apply(A, B, X)) <= TOL


@pytest.mark.parametrize("L,d,dk,dv", [(1, 2, 3, 2), (4, 3, 2, 5), (5, 4, 4, 4), (9, 40, 3, 5)])  # L d > 256: column tiles
def test_attention(kernels, rng, L, d, dk, dv):
    X, WQ, WK, WV = (rng.standard_normal(s) for s in ((L, d), (d, dk), (d, dk), (d, dv)))
    assert rel(_gpu.attention(X, WQ, WK, WV), blockhess.attention(X, WQ, WK, WV)) <= TOL
    for wrt in ("W_Q", "W_K", "W_V", "X"):
        got = _gpu.attention_jacobian(X, WQ, WK, WV, wrt)
        want = blockhess.attention_jacobian(X, WQ, WK, WV, wrt)
        assert rel(got, want) <= TOL, wrt


@pytest.mark.parametrize("L,d,f,e", [(1, 2, 3, 2), (4, 3, 5, 2), (3, 4, 4, 4)])
def test_ffn(kernels, rng, L, d, f, e):
    Y, W1, W2 = rng.standard_normal((L, d)), rng.standard_normal((d, f)), rng.standard_normal((f, e))
    assert rel(_gpu.ffn(Y, W1, W2), blockhess.ffn(Y, W1, W2)) <= TOL
    for wrt in ("W_1", "W_2", "Y"):
        assert rel(_gpu.ffn_jacobian(Y, W1, W2, wrt, "dense"), blockhess.ffn_jacobian(Y, W1, W2, wrt)) <= TOL
    assert rel(_gpu.ffn_jacobian(Y, W1, W2, "Y", "blocks"), blockhess.ffn_jacobian(Y, W1, W2, "Y", layout="blocks")) <= TOL
    for wrt in ("W_1", "W_2"):
        for got, want in zip(_gpu.ffn_jacobian(Y, W1, W2, wrt, "kron"), blockhess.ffn_jacobian(Y, W1, W2, wrt, layout="kron")):
            assert rel(got, want) <= TOL, wrt
    for layout in ("dense", "blocks"):
        np.testing.assert_array_equal(_gpu.ffn_cross_hessian(Y, W1, W2, layout),
                                      blockhess.ffn_cross_hessian(Y, W1, W2, layout=layout))


def _block(rng, B, L, d, dk, dff, dtype=np.float64):
    params = blockhess.BlockParams(*(rng.standard_normal(s).astype(dtype) * 0.6
                                     for s in ((d, dk), (d, dk), (d, d), (d, dff), (dff, d))))
    X = rng.standard_normal((B, L, d)).astype(dtype)
    return X, params


BLOCK_SHAPES = [(1, 3, 4, 2, 5), (2, 4, 3, 3, 6), (1, 5, 6, 4, 3)]


def _hessian(X, params, eps, kind, values, classes, part, selected):
    """_gpu.loss_hessian (the engine with its GPU assembly target) on the paper's block."""
    P = sum(n for n, s in zip(params.sizes, selected) if s)
    return _gpu.loss_hessian(X, params.spec._core(), params.arrays, eps, kind, values, classes, part, selected, P,
                             None, (None, None))


@pytest.mark.parametrize("B,L,d,dk,dff", BLOCK_SHAPES)
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("part", ["full", "outer", "functional"])
def test_block_loss_hessian(kernels, rng, B, L, d, dk, dff, loss, part):
    X, params = _block(rng, B, L, d, dk, dff)
    target = rng.standard_normal(X.shape) if loss == "mse" else rng.integers(0, d, size=(B, L))
    kind = 0 if loss == "mse" else 1
    values, classes = (target, None) if loss == "mse" else (None, target)
    code = ("full", "outer", "functional").index(part)
    H = _hessian(X, params, 1e-3, kind, values, classes, code, [True] * 5)
    want = blockhess.loss_hessian(X, target, params, loss=loss, part=part, eps=1e-3)
    assert rel(H, want) <= TOL
    np.testing.assert_array_equal(H, H.T)


def test_block_loss_hessian_with_blocks_wider_than_a_thread_block(kernels, rng):
    """W_1 and W_2 of 8 x 40 = 320 entries: the assembly kernels tile their columns over gridDim.y."""
    X, params = _block(rng, 2, 4, 8, 8, 40)
    T = rng.standard_normal(X.shape)
    H = _hessian(X, params, 1e-3, 0, T, None, 0, [True] * 5)
    assert rel(H, blockhess.loss_hessian(X, T, params, eps=1e-3)) <= TOL
    np.testing.assert_array_equal(H, H.T)


@pytest.mark.parametrize("wrt", [("W_Q",), ("W_K", "W_2"), ("W_Q", "W_K", "W_V"), ("W_V", "W_1")])
def test_block_loss_hessian_subsets(kernels, rng, wrt):
    X, params = _block(rng, 2, 4, 3, 2, 5)
    T = rng.standard_normal(X.shape)
    selected = [n in wrt for n in params.names]
    H = _hessian(X, params, 0.0, 0, T, None, 0, selected)
    assert rel(H, blockhess.loss_hessian(X, T, params, wrt=wrt)) <= TOL


def test_block_output_hessian(kernels, rng):
    X, params = _block(rng, 1, 3, 4, 2, 3)
    for i, j in ((0, 0), (0, 1), (4, 0), (3, 4), (2, 2), (1, 3)):
        shape = (X.shape[1] * X.shape[2] * params.sizes[i], params.sizes[j])
        got = _gpu.block_output_hessian(X, params.spec._core(), params.arrays, 1e-3, i, j, shape)
        want = blockhess.block_output_hessian(X[0], params, params.names[i], params.names[j], eps=1e-3)
        assert rel(got, want) <= TOL, (i, j)


def test_block_float32(kernels, rng):
    X, params = _block(rng, 2, 4, 3, 3, 4, dtype=np.float32)
    T = rng.standard_normal(X.shape).astype(np.float32)
    H = _hessian(X, params, 1e-3, 0, T, None, 0, [True] * 5)
    assert H.dtype == np.float32
    assert rel(H, blockhess.loss_hessian(X, T, params, eps=1e-3)) <= 1e-4


# ---- the public functions, dispatched to the GPU path with "device" arrays ----------------------

@pytest.fixture
def device(monkeypatch, kernels):
    cupy_emulation.install(monkeypatch)
    for name in [n for n in dir(_gpu) if not n.startswith("_") and callable(getattr(_gpu, n))]:
        original = getattr(_gpu, name)
        if getattr(original, "__module__", None) != _gpu.__name__ or isinstance(original, type):
            continue

        def spy(*args, _original=original, _name=name, **kwargs):
            kernels.calls.append("_gpu." + _name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_gpu, name, spy)
    return lambda a: None if a is None else cupy_emulation.to_device(np.asarray(a))


def test_public_functions_dispatch_to_the_gpu_path(device, kernels, rng):
    X, gamma, G = rng.standard_normal((4, 5)), rng.standard_normal(5), rng.standard_normal((4, 5))
    T, Xk = rng.standard_normal((3, 4)), rng.standard_normal((4, 5))
    D = device
    cases = [
        (lambda f: blockhess.layernorm(f(X), 1e-3, f(gamma), f(gamma))),
        (lambda f: blockhess.layernorm_jacobian(f(X), gamma=f(gamma))),
        (lambda f: blockhess.layernorm_jacobian(f(X), layout="blocks", wrt="beta")),
        (lambda f: blockhess.layernorm_hessian(f(X), eps=1e-2, layout="blocks")),
        (lambda f: blockhess.layernorm_hessian(f(X), gamma=f(gamma))),
        (lambda f: blockhess.layernorm_hessian_contract(f(X), f(G), gamma=f(gamma))),
        (lambda f: blockhess.softmax(f(T))),
        (lambda f: blockhess.softmax_jacobian(f(T), layout="blocks")),
        (lambda f: blockhess.softmax_hessian(f(T))),
        (lambda f: blockhess.vec_r(f(T))),
        (lambda f: blockhess.unvec_r(f(T.reshape(-1)), 4, 3)),
        (lambda f: blockhess.commute(f(T.reshape(-1)), 3, 4)),
        (lambda f: blockhess.commutation_matrix(3, 4, like=f(T))),
        (lambda f: blockhess.kron_apply(f(T), f(X), f(Xk))),
    ]
    WQ, WK, WV = rng.standard_normal((5, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    for wrt in ("W_Q", "W_K", "W_V", "X"):
        cases.append(lambda f, wrt=wrt: blockhess.attention_jacobian(f(X), f(WQ), f(WK), f(WV), wrt))
    cases.append(lambda f: blockhess.attention(f(X), f(WQ), f(WK), f(WV)))
    W1, W2 = rng.standard_normal((5, 6)), rng.standard_normal((6, 3))
    for wrt, layout in (("W_1", "dense"), ("W_2", "dense"), ("Y", "dense"), ("Y", "blocks")):
        cases.append(lambda f, wrt=wrt, layout=layout: blockhess.ffn_jacobian(f(X), f(W1), f(W2), wrt, layout=layout))
    cases.append(lambda f: blockhess.ffn(f(X), f(W1), f(W2)))
    for layout in ("dense", "blocks"):
        cases.append(lambda f, layout=layout: blockhess.ffn_cross_hessian(f(X), f(W1), f(W2), layout=layout))
    for k, case in enumerate(cases):
        kernels.calls.clear()
        got, want = case(D), case(lambda a: a)
        assert any(c.startswith("_gpu.") for c in kernels.calls), f"case {k} did not reach the GPU path"
        assert rel(got, want) <= TOL, k


def test_block_functions_dispatch_to_the_gpu_path(device, kernels, rng):
    import reference as ref

    X, W, target, classes = ref.random_block(rng, 4, 3, 2, 5, B=2)
    params = blockhess.BlockParams(*W)
    dparams = blockhess.BlockParams(*(device(w) for w in W))
    Xd, Td, Cd = device(X), device(target), device(classes)
    kernels.calls.clear()
    assert rel(blockhess.block_forward(Xd, dparams), blockhess.block_forward(X, params)) <= TOL
    assert rel(blockhess.block_forward(Xd[0], dparams), blockhess.block_forward(X[0], params)) <= TOL
    assert rel(blockhess.block_jacobian(Xd[1], dparams, "W_K"), blockhess.block_jacobian(X[1], params, "W_K")) <= TOL
    assert rel(blockhess.block_output_hessian(Xd[0], dparams, "W_2", "W_Q"),
               blockhess.block_output_hessian(X[0], params, "W_2", "W_Q")) <= TOL
    for tgt_d, tgt, loss in ((Td, target, "mse"), (Cd, classes, "cross_entropy")):
        assert abs(blockhess.loss_value(Xd, tgt_d, dparams, loss=loss) - blockhess.loss_value(X, tgt, params, loss=loss)) < 1e-12
        assert rel(blockhess.loss_gradient(Xd, tgt_d, dparams, loss=loss), blockhess.loss_gradient(X, tgt, params, loss=loss)) <= TOL
        H = blockhess.loss_hessian(Xd, tgt_d, dparams, loss=loss, part="functional")
        assert rel(H, blockhess.loss_hessian(X, tgt, params, loss=loss, part="functional")) <= TOL
        blocks = blockhess.loss_hessian(Xd, tgt_d, dparams, loss=loss, layout="blocks", wrt=("W_V", "W_2"))
        want = blockhess.loss_hessian(X, tgt, params, loss=loss, layout="blocks", wrt=("W_V", "W_2"))
        assert all(rel(blocks[k], want[k]) <= TOL for k in want)
    assert "loss_hessian" in kernels.calls  # the engine's binding, with its GPU assembly target
    with pytest.raises(TypeError, match="mix host"):
        blockhess.loss_hessian(Xd, target, dparams)
    with pytest.raises(ValueError, match="out of range"):
        blockhess.loss_hessian(Xd, device(classes + 3), dparams, loss="cross_entropy")
