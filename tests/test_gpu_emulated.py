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
from blockhess import _core, _gpu, _gpu_launch

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


def both(name, *args, shape, dtype=np.float64):
    """The same call on both modules: _gpu.name(*args, out) (the GPU path, with the emulated kernels)
    and _core.name(*args, out) (the CPU core), which _backend.kernels_for swaps for each other."""
    got, want = np.empty(shape, dtype=dtype), np.empty(shape, dtype=dtype)
    getattr(_gpu, name)(*args, got)
    getattr(_core, name)(*args, want)
    return got, want


def test_the_gpu_module_has_the_cores_names_and_kernels_for_picks_between_them(monkeypatch):
    """_backend.kernels_for swaps _core and _gpu: every function of _gpu is one of _core's (the tests
    below call both with the same arguments), host arrays get _core, device arrays _gpu, and a mix
    is a TypeError."""
    import inspect

    from blockhess import _backend

    functions = [n for n, f in vars(_gpu).items() if inspect.isfunction(f) and f.__module__ == _gpu.__name__
                 and not n.startswith("_")]
    assert len(functions) == 17 and all(hasattr(_core, n) for n in functions), functions
    cupy_emulation.install(monkeypatch)
    host, device = np.zeros(3), cupy_emulation.to_device(np.zeros(3))
    assert _backend.kernels_for(host, None) is _core and _backend.kernels_for(device, None) is _gpu
    with pytest.raises(TypeError, match="mix host"):
        _backend.kernels_for(host, device)


@pytest.mark.parametrize("L,d", [(1, 2), (3, 5), (6, 4)])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("affine", [False, True])
def test_layernorm(kernels, rng, L, d, eps, affine):
    X = rng.standard_normal((L, d)) + 0.2
    gamma = rng.standard_normal(d) if affine else None
    beta = rng.standard_normal(d) if affine else None
    G = rng.standard_normal((L, d))
    scale = 1.0 if d == 2 else 1e-300
    r = lambda ab: np.linalg.norm(ab[0] - ab[1]) / max(np.linalg.norm(ab[1]), scale)  # noqa: E731
    assert r(both("layernorm_forward", X, eps, gamma, beta, shape=(L, d))) <= TOL
    for kind, shape in ((0, (L, d, d)), (1, (L * d, L * d)), (2, (L * d, d)), (3, (L * d, d))):
        assert r(both("layernorm_jacobian", X, eps, gamma, kind, shape=shape)) <= TOL  # gamma, beta: block reductions
    for kind, shape in ((0, (L, d, d, d)), (1, ((L * d) ** 2, L * d))):
        assert r(both("layernorm_hessian", X, eps, gamma, kind, shape=shape)) <= TOL
    assert r(both("layernorm_hessian_contract", X, eps, gamma, G, shape=(L, d, d))) <= TOL
    assert {"layernorm_forward", "layernorm_jacobian_dense", "layernorm_jacobian_blocks", "layernorm_hessian_dense",
            "layernorm_hessian_blocks", "layernorm_hessian_contract"} <= set(kernels.calls)


def test_layernorm_zero_variance_message_matches_cpu(kernels):
    X = np.array([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]])
    with pytest.raises(ValueError) as cpu:
        blockhess.layernorm_jacobian(X)
    out = lambda *shape: np.empty(shape)  # noqa: E731
    for call in (lambda: _gpu.layernorm_forward(X, 0.0, None, None, out(2, 3)),
                 lambda: _gpu.layernorm_jacobian(X, 0.0, None, 0, out(2, 3, 3)),
                 lambda: _gpu.layernorm_hessian(X, 0.0, None, 1, out(36, 6)),
                 lambda: _gpu.layernorm_hessian_contract(X, 0.0, None, X, out(2, 3, 3))):
        with pytest.raises(ValueError) as gpu:
            call()
        assert str(gpu.value) == str(cpu.value)
    J = out(2, 3, 3)
    _gpu.layernorm_jacobian(X, 1e-5, None, 0, J)
    assert np.isfinite(J).all()


def test_non_finite_results_are_named_as_the_core_names_them(kernels):
    """An overflowing result: the GPU path raises the core's NonFiniteError, naming the same stage."""
    X, W = np.full((2, 3), 1e200), np.full((3, 3), 1e200)
    for name, args, shape, stage in (("attention_forward", (X, W, W, W), (2, 3), "the attention output"),
                                     ("ffn_forward", (X, W, W), (2, 3), "the FFN output"),
                                     ("ffn_jacobian", (X, W, W, 0), (6, 9), "the FFN Jacobian with respect to W_1")):
        for module in (_core, _gpu):
            with pytest.raises(blockhess.NonFiniteError, match="^" + stage), np.errstate(all="ignore"):  # NumPy's
                getattr(module, name)(*args, np.empty(shape))  # overflow warnings, which CuPy does not give


@pytest.mark.parametrize("m,n", [(1, 1), (3, 3), (2, 5), (4, 3)])
def test_softmax(kernels, rng, m, n):
    T = rng.standard_normal((m, n)) * 2
    assert rel(*both("softmax_forward", T, shape=(m, n))) <= TOL
    for kind, jacobian, hessian in ((0, (m, n, n), (m, n, n, n)), (1, (m * n, m * n), ((m * n) ** 2, m * n))):
        assert rel(*both("softmax_jacobian", T, kind, shape=jacobian)) <= TOL
        assert rel(*both("softmax_hessian", T, kind, shape=hessian)) <= TOL


@pytest.mark.parametrize("rows,n", [(4, 70), (2, 300)])
def test_rows_longer_than_a_warp(kernels, rng, rows, n):
    """Row kernels whose rows span several warps (block reductions across warps) or more than one
    block of threads (strided loops), LayerNorm and softmax, against the CPU core and NumPy."""
    from blockhess import _gpu_launch

    X = rng.standard_normal((rows, n)) * 1.5 + 0.3
    gamma, G = rng.standard_normal(n), rng.standard_normal((rows, n))
    assert rel(*both("layernorm_forward", X, 1e-3, gamma, gamma, shape=(rows, n))) <= TOL
    assert rel(*both("layernorm_jacobian", X, 1e-3, gamma, 0, shape=(rows, n, n))) <= TOL
    assert rel(*both("layernorm_hessian_contract", X, 1e-3, gamma, G, shape=(rows, n, n))) <= TOL
    A, want = both("softmax_forward", X, shape=(rows, n))
    assert rel(A, want) <= TOL
    assert rel(*both("softmax_jacobian", X, 0, shape=(rows, n, n))) <= TOL
    if n <= 70:
        assert rel(*both("layernorm_hessian", X, 1e-3, gamma, 0, shape=(rows, n, n, n))) <= TOL
        assert rel(*both("softmax_hessian", X, 0, shape=(rows, n, n, n))) <= TOL
    w = A * (G - (A * G).sum(axis=1, keepdims=True))
    vjp, contract = np.empty_like(A), np.empty((rows, n, n))
    _gpu_launch.softmax_vjp(A, G, vjp)
    _gpu_launch.softmax_hessian_contract(A, G, contract)
    assert rel(vjp, w) <= TOL
    want = np.eye(n) * w[:, None, :] - A[:, :, None] * w[:, None, :] - w[:, :, None] * A[:, None, :]
    assert rel(contract, want) <= TOL


def test_commutation(kernels, rng):
    v, M = rng.standard_normal(15), rng.standard_normal((15, 4))
    np.testing.assert_array_equal(*both("commute", v, 3, 5, shape=(15,)))
    np.testing.assert_array_equal(*both("commute", M, 5, 3, shape=(15, 4)))
    np.testing.assert_array_equal(*both("commutation_dense", 3, 5, shape=(15, 15)))
    A, B, X = rng.standard_normal((3, 5)), rng.standard_normal((2, 4)), rng.standard_normal((5, 4))
    assert rel(*both("kron_apply", A, B, X, shape=(6,))) <= TOL


@pytest.mark.parametrize("L,d,dk,dv", [(1, 2, 3, 2), (4, 3, 2, 5), (5, 4, 4, 4), (9, 40, 3, 5)])
def test_attention(kernels, rng, L, d, dk, dv):
    """The attention's functions on the GPU are the engine's on the GPU backend, one _cuda binding
    each (its factors formed there, its input Jacobian in closed form), equal to the host's to
    rounding; with one token (L = 1) the query and key Jacobians are exactly 0 on both."""
    X, WQ, WK, WV = (rng.standard_normal(s) for s in ((L, d), (d, dk), (d, dk), (d, dv)))
    assert rel(*both("attention_forward", X, WQ, WK, WV, shape=(L, dv))) <= TOL
    for wrt, n in enumerate((d * dk, d * dk, d * dv, L * d)):  # W_Q, W_K, W_V, X
        gpu, cpu = both("attention_jacobian", X, WQ, WK, WV, wrt, shape=(L * dv, n))
        if L == 1 and wrt < 2:
            assert not gpu.any() and not cpu.any(), wrt
        else:
            assert rel(gpu, cpu) <= TOL, wrt
    assert kernels.calls == ["attention_forward"] + ["attention_jacobian"] * 4, kernels.calls


@pytest.mark.parametrize("L,d,f,e", [(1, 2, 3, 2), (4, 3, 5, 2), (3, 4, 4, 4)])
def test_ffn(kernels, rng, L, d, f, e):
    """The FFN's functions on the GPU are the engine's on the GPU backend, one _cuda binding each
    (its factors pushed there), equal to the host's to rounding; the cross derivative's values are
    single products, the host's bits."""
    Y, W1, W2 = rng.standard_normal((L, d)), rng.standard_normal((d, f)), rng.standard_normal((f, e))
    assert rel(*both("ffn_forward", Y, W1, W2, shape=(L, e))) <= TOL
    shapes = ((L * e, d * f), (L * e, f * e), (L * e, L * d), (L, e, d), (L, e, f), (L, f))  # kinds 0..5
    for kind, shape in enumerate(shapes):
        assert rel(*both("ffn_jacobian", Y, W1, W2, kind, shape=shape)) <= TOL, kind
    for kind, shape in ((0, (L, d, f)), (1, (L * e * d * f, f * e))):
        np.testing.assert_array_equal(*both("ffn_cross_hessian", Y, W1, W2, kind, shape=shape))
    assert kernels.calls == ["ffn_forward"] + ["ffn_jacobian"] * 6 + ["ffn_cross_hessian"] * 2, kernels.calls


def test_sublayer_bindings_check_what_python_checked(kernels, rng):
    """_cuda's attention and FFN bindings re-check the shapes, the kind and wrt as _core's do, with the
    same messages."""
    Y, W1, W2 = rng.standard_normal((3, 2)), rng.standard_normal((2, 4)), rng.standard_normal((4, 2))
    X, WQ, WV = rng.standard_normal((3, 2)), rng.standard_normal((2, 4)), rng.standard_normal((2, 5))
    for name, args in (("ffn_jacobian", (Y, W1, W2, 0, np.empty((6, 7)))),
                       ("ffn_jacobian", (Y, W1, W2, 6, np.empty((6, 8)))),
                       ("ffn_cross_hessian", (Y, W1, W2, 2, np.empty((3, 2, 4)))),
                       ("ffn_jacobian", (Y, W1[:1], W2, 0, np.empty((6, 8)))),
                       ("attention_forward", (X, WQ, WQ, WV, np.empty((3, 4)))),
                       ("attention_jacobian", (X, WQ, WQ, WV, 4, np.empty((15, 8)))),
                       ("attention_jacobian", (X, WQ, WQ, WV, 3, np.empty((15, 8)))),
                       ("attention_jacobian", (X, WQ, WQ[:1], WV, 0, np.empty((15, 8))))):
        with pytest.raises(ValueError) as gpu:
            getattr(_gpu, name)(*args)
        with pytest.raises(ValueError) as cpu:
            getattr(_core, name)(*(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a for a in args))
        assert str(gpu.value) == str(cpu.value)


def _block(rng, B, L, d, dk, dff, dtype=np.float64):
    params = blockhess.BlockParams(*(rng.standard_normal(s).astype(dtype) * 0.6
                                     for s in ((d, dk), (d, dk), (d, d), (d, dff), (dff, d))))
    X = rng.standard_normal((B, L, d)).astype(dtype)
    return X, params


BLOCK_SHAPES = [(1, 3, 4, 2, 5), (2, 4, 3, 3, 6), (1, 5, 6, 4, 3)]


def _hessian(X, params, eps, kind, values, classes, part, selected):
    """_gpu.loss_hessian (the engine with its GPU assembly target) on the paper's block."""
    P = sum(n for n, s in zip(params.sizes, selected) if s)
    H = np.empty((P, P), dtype=X.dtype)
    _gpu.loss_hessian(X, params.spec._core(), list(params.arrays), eps, kind, values, classes, part, selected, H,
                      None, None)
    return H


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
        got = np.empty(shape)
        _gpu.block_output_hessian(X, params.spec._core(), list(params.arrays), 1e-3, i, j, got)
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
        assert isinstance(got, cupy_emulation.DevArray), f"case {k} did not return a device array"
        copies = k in (9, 10)  # vec_r and unvec_r: array copies, no kernel
        assert copies or any(c.startswith("_gpu.") for c in kernels.calls), f"case {k} did not reach the GPU path"
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


# ---- the engine on the GPU backend through the public functions ---------------------------------

GPU_ENGINE_SPECS = {
    "paper": blockhess.BlockSpec(),
    "gpt2": blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                                activation="gelu_tanh", causal=True, eps=1e-5),
    "rmsnorm-silu": blockhess.BlockSpec(norm="rmsnorm", norm_affine=True, activation="silu", heads=3, out_proj=True,
                                        eps=1e-5),
    "2-layer stack": blockhess.ModelSpec(blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True,
                                                             heads=2, out_proj=True, eps=1e-5),
                                         n_layers=2, final_norm=True),
    "vit": blockhess.ModelSpec(blockhess.BlockSpec(norm_position="pre", norm_affine=True, heads=2, out_proj=True,
                                                   eps=1e-5),
                               n_layers=2, final_norm=True, patch_dim=5, n_positions=6, classes=4, class_token=True),
    "vit, mean-pooled": blockhess.ModelSpec(blockhess.BlockSpec(norm_position="pre", norm_affine=True, heads=2,
                                                                out_proj=True, eps=1e-5),
                                            n_layers=2, final_norm=True, patch_dim=5, n_positions=6, classes=4),
    "gpt2 lm": blockhess.ModelSpec(blockhess.BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2,
                                                       out_proj=True, activation="gelu_tanh", causal=True, eps=1e-5),
                                   n_layers=2, final_norm=True, vocab_size=9, n_positions=5, lm_head=True),
}
GPU_ENGINE_CASES = ([(name, loss) for name in ("paper", "gpt2", "rmsnorm-silu", "2-layer stack", "vit")
                     for loss in ("mse", "cross_entropy")]
                    + [("paper", "pooled_cross_entropy"), ("vit", "pooled_cross_entropy"),
                       ("vit, mean-pooled", "pooled_cross_entropy"), ("gpt2 lm", "next_token"),
                       ("gpt2 lm", "cross_entropy")])


def _engine_inputs(rng, name: str, loss: str):
    """X (a language model's token ids, repeated; a ViT's patches of 5), the loss's target and a
    pooled head (W_C, b_C) where the model has no classifier of its own."""
    if name == "gpt2 lm":
        X, out_shape = rng.integers(0, 4, size=(2, 5)), (2, 5, 9)
    elif name.startswith("vit"):  # 4 classes; a class token's row more out
        X, out_shape = rng.standard_normal((2, 5, 5)), (2, 6 if name == "vit" else 5, 4)
    else:
        X, out_shape = rng.standard_normal((2, 5, 6)), (2, 5, 6)
    head = None
    if loss == "mse":
        target = rng.standard_normal(out_shape)
    elif loss == "pooled_cross_entropy":  # a class a sample: the class token's logits, or the tokens' mean's
        if name == "paper":
            head = (rng.standard_normal((6, 3)), rng.standard_normal(3))
        target = rng.integers(0, 3 if head else out_shape[-1], size=out_shape[0])
    else:
        target = rng.integers(0, out_shape[-1], size=out_shape[:2])
        if loss == "next_token":
            target[1, 3] = -100  # an ignored label
    return X, target, head


@pytest.mark.parametrize("name", ["paper", "gpt2", "rmsnorm-silu", "2-layer stack", "gpt2 lm"])
def test_block_jacobians_run_on_the_gpu_engine(device, kernels, rng, name):
    """block_jacobian on GPU arrays is _cuda's block_jacobian, the engine on the GPU backend, for
    every parameter of a block or a model: from the factors where they reach the output (a pre-LN
    block's first norm's mixed by the attention there; a stack's lower norms and biases mixed by the
    upper attention), else a forward tangent per entry (a lower layer's weights, the embeddings).
    The result is on the device and equal to the host's."""
    spec = GPU_ENGINE_SPECS[name]
    params = blockhess.BlockParams.random(spec, d=6, d_k=4, d_ff=7, seed=5)
    dparams = blockhess.BlockParams.from_arrays(spec, {n: device(a) for n, a in zip(params.names, params.arrays)})
    X = rng.integers(0, spec.vocab_size, size=5) if name == "gpt2 lm" else rng.standard_normal((5, 6))
    for wrt in params.names:
        kernels.calls.clear()
        got, want = blockhess.block_jacobian(device(X), dparams, wrt), blockhess.block_jacobian(X, params, wrt)
        assert isinstance(got, cupy_emulation.DevArray) and kernels.calls == ["block_jacobian"], kernels.calls
        assert rel(got, want) <= TOL or not np.abs(want).max(), wrt


def test_the_gpu_block_jacobian_checks_its_sample(device, kernels, rng):
    params = blockhess.BlockParams.random(GPU_ENGINE_SPECS["paper"], d=6, d_k=4, d_ff=7, seed=5)
    out = np.empty((30, params.sizes[0]))
    with pytest.raises(ValueError, match="one sample only"):
        _gpu_launch.engine_block_jacobian(rng.standard_normal((2, 5, 6)), params.spec._core(), params.arrays, 0.0, 0,
                                          out)


@pytest.mark.parametrize("name,loss", GPU_ENGINE_CASES)
def test_hessian_vector_products_run_on_the_gpu_engine(device, kernels, rng, name, loss):
    """loss_hvp, hessian_operator's products and loss value, loss_gradient, loss_value and
    block_forward on GPU arrays run the engine on the GPU backend (_cuda's loss_hvp,
    HessianOperator, loss_gradient, block_forward: no host copy of the inputs), the results on the
    device, equal to the host engine's to rounding; each part."""
    spec = GPU_ENGINE_SPECS[name]
    params = blockhess.BlockParams.random(spec, d=6, d_k=4, d_ff=7, seed=5)
    dparams = blockhess.BlockParams.from_arrays(spec, {n: device(a) for n, a in zip(params.names, params.arrays)})
    X, target, head = _engine_inputs(rng, name, loss)
    dhead = None if head is None else tuple(device(h) for h in head)
    V = rng.standard_normal((params.size, 2))
    for part in ("full", "outer", "functional"):
        kernels.calls.clear()
        kw = dict(loss=loss, part=part)
        got = blockhess.loss_hvp(device(X), device(target), dparams, device(V), head=dhead, **kw)
        got_1d = blockhess.loss_hvp(device(X), device(target), dparams, device(V[:, 1]), head=dhead, **kw)
        op = blockhess.hessian_operator(device(X), device(target), dparams, head=dhead, **kw)
        by_op = op @ device(V)
        want = blockhess.loss_hvp(X, target, params, V, head=head, **kw)
        assert all(isinstance(a, cupy_emulation.DevArray) for a in (got, got_1d, by_op))
        assert kernels.calls.count("loss_hvp") == 2 and "HessianOperator" in kernels.calls, kernels.calls
        assert rel(got, want) <= TOL and rel(got_1d, want[:, 1]) <= TOL and rel(by_op, want) <= TOL, part
        assert abs(op.loss_value - blockhess.loss_value(X, target, params, loss=loss, head=head)) < 1e-12
    kernels.calls.clear()
    grad = blockhess.loss_gradient(device(X), device(target), dparams, loss=loss, head=dhead)
    assert isinstance(grad, cupy_emulation.DevArray) and kernels.calls == ["loss_gradient"], kernels.calls
    assert rel(grad, blockhess.loss_gradient(X, target, params, loss=loss, head=head)) <= TOL
    kernels.calls.clear()
    Z = blockhess.block_forward(device(X), dparams)
    assert isinstance(Z, cupy_emulation.DevArray) and kernels.calls == ["block_forward"], kernels.calls
    assert rel(Z, blockhess.block_forward(X, params)) <= TOL
    kernels.calls.clear()
    value = blockhess.loss_value(device(X), device(target), dparams, loss=loss, head=dhead)
    assert kernels.calls == ["loss_gradient"], kernels.calls  # the loss alone: its gradient not asked for
    assert abs(value - blockhess.loss_value(X, target, params, loss=loss, head=head)) < 1e-12


@pytest.mark.parametrize("name,loss", [("gpt2", "cross_entropy"), ("paper", "pooled_cross_entropy"),
                                       ("vit", "pooled_cross_entropy"), ("vit, mean-pooled", "pooled_cross_entropy")])
def test_the_gpu_engine_checks_a_loss_target_as_the_host_does(device, rng, name, loss):
    """A class out of range is the host's ValueError on the GPU engine too, word for word (its head
    checks the classes it reads back as well), never a wrong product."""
    spec = GPU_ENGINE_SPECS[name]
    params = blockhess.BlockParams.random(spec, d=6, d_k=4, d_ff=7, seed=5)
    dparams = blockhess.BlockParams.from_arrays(spec, {n: device(a) for n, a in zip(params.names, params.arrays)})
    X, target, head = _engine_inputs(rng, name, loss)
    target = np.full_like(target, 3 if head else target.max() + 5)  # past the last class
    dhead = None if head is None else tuple(device(h) for h in head)
    v = rng.standard_normal(params.size)
    with pytest.raises(ValueError, match="out of range") as on_host:
        blockhess.loss_hvp(X, target, params, v, loss=loss, head=head)
    with pytest.raises(ValueError, match="out of range") as on_gpu:
        blockhess.loss_hvp(device(X), device(target), dparams, device(v), loss=loss, head=dhead)
    assert str(on_gpu.value) == str(on_host.value)


def test_the_gpu_engine_checks_a_language_models_ids_and_labels_as_the_host_does(device, rng):
    """A token id or a next-token label out of range is the host's ValueError on the GPU engine too
    (the embedding checks the ids it reads back, the head the labels), never a wrong product."""
    spec = GPU_ENGINE_SPECS["gpt2 lm"]
    params = blockhess.BlockParams.random(spec, d=6, d_k=4, d_ff=7, seed=5)
    dparams = blockhess.BlockParams.from_arrays(spec, {n: device(a) for n, a in zip(params.names, params.arrays)})
    ids, labels, v = rng.integers(0, 9, size=(2, 5)), rng.integers(0, 9, size=(2, 5)), rng.standard_normal(params.size)
    bad_ids = ids.copy()
    bad_ids[1, 2] = 9
    for X, target in ((bad_ids, labels), (ids, np.where(labels == labels[0, 1], 9, labels))):
        with pytest.raises(ValueError, match="out of range") as on_host:
            blockhess.loss_hvp(X, target, params, v, loss="next_token")
        with pytest.raises(ValueError, match="out of range") as on_gpu:
            blockhess.loss_hvp(device(X), device(target), dparams, device(v), loss="next_token")
        assert str(on_gpu.value) == str(on_host.value)


def test_a_language_models_other_functions_take_gpu_ids(device, kernels, rng):
    """The rest of a language model's functions on GPU ids: its output, loss, dense Hessian (the
    host engine's per-token work and products, the Hessian on the device), blocks of it and the
    operator's diagonal, each the host's, on the device."""
    spec = GPU_ENGINE_SPECS["gpt2 lm"]
    params = blockhess.BlockParams.random(spec, d=6, d_k=4, d_ff=7, seed=5)
    dparams = blockhess.BlockParams.from_arrays(spec, {n: device(a) for n, a in zip(params.names, params.arrays)})
    ids, labels, _ = _engine_inputs(rng, "gpt2 lm", "next_token")
    wrt = ("h.1", "ln_f")
    cases = [
        lambda f, p: blockhess.block_forward(f(ids), p),
        lambda f, p: blockhess.block_forward(f(ids[0]), p),
        lambda f, p: blockhess.loss_hessian(f(ids), f(labels), p, loss="next_token", wrt=wrt),
        lambda f, p: blockhess.loss_hessian(f(ids), f(labels), p, loss="next_token", wrt=("wpe", "h.1.W_2"),
                                            part="outer"),
        lambda f, p: blockhess.hessian_operator(f(ids), f(labels), p, loss="next_token", wrt=wrt).diagonal(),
    ]
    for k, case in enumerate(cases):
        got, want = case(device, dparams), case(lambda a: a, params)
        assert isinstance(got, cupy_emulation.DevArray), k
        assert rel(got, want) <= TOL, k
    value = blockhess.loss_value(device(ids), device(labels), dparams, loss="next_token")
    assert abs(value - blockhess.loss_value(ids, labels, params, loss="next_token")) < 1e-12
