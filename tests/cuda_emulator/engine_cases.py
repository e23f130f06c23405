"""Runs the engine on the GPU backend, on the CPU kernel emulator, in a process of its own:
tests/test_gpu_engine.py starts it, since a node that touches the GPU's memory from the host faults
there (cuda_runtime.h's DeviceMemory) and takes the process with it.

    python engine_cases.py LIBRARY OUT.npz

For every case of CASES: the loss, its gradient and one Hessian-vector product of a block of the
family or a model (a ViT, a GPT-2-like language model), each loss and part, through
backend_probe.cpp's block_loss_hvp on the host backend and on the GPU backend, and the same through
blockhess's public functions (their host engine); for every case of FFN_CASES, the FFN sublayer's
output, Jacobians, Kronecker factors and cross second derivative the same three ways; into OUT.npz.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np

import blockhess
from blockhess import BlockParams, BlockSpec, ModelSpec
from blockhess.block import _batch
from blockhess.hvp import _problem

SPECS = {
    "paper": BlockSpec(),
    "gpt2": BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                      activation="gelu_tanh", causal=True, eps=1e-5),
    "rmsnorm": BlockSpec(norm_position="post", norm="rmsnorm", norm_affine=True, activation="silu", heads=3,
                         out_proj=True, eps=1e-5),
    "attention_only": BlockSpec(attention_only=True, heads=2, out_proj=True, bias=True),
    # a ViT: patch embedding, class token, learned positions, 2 blocks, final norm, classifier
    "vit": ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                               activation="gelu", eps=1e-5),
                     n_layers=2, final_norm=True, patch_dim=5, n_positions=6, classes=3, class_token=True),
    # the same ViT without the class token: its loss the pooled mean's
    "vit_mean": ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                                    activation="gelu", eps=1e-5),
                          n_layers=2, final_norm=True, patch_dim=5, n_positions=6, classes=3),
    # a GPT-2-like language model: token embedding, learned positions, 2 blocks, final norm, tied LM head
    "lm": ModelSpec(BlockSpec(norm_position="pre", norm_affine=True, bias=True, heads=2, out_proj=True,
                              activation="gelu_tanh", causal=True, eps=1e-5),
                    n_layers=2, final_norm=True, vocab_size=11, n_positions=5, lm_head=True),
}
LOSSES = ("mse", "cross_entropy")
OWN_LOSSES = {"vit": LOSSES + ("pooled_cross_entropy",),  # its class token's logits
              "vit_mean": ("pooled_cross_entropy",),  # the mean of its tokens' logits
              "lm": ("next_token", "cross_entropy")}
PARTS = ("full", "outer", "functional")
DTYPES = {"f64": np.float64, "f32": np.float32}
CASES = [(spec, loss, part, dtype) for spec in SPECS for loss in OWN_LOSSES.get(spec, LOSSES) for part in PARTS
         for dtype in DTYPES]
B, L, D = 2, 5, 6
PATCH = 5  # the ViT's input width


def widths(spec: str) -> tuple[int, int, int]:
    """The input's and the output's width, and the output's tokens (a class token's one more)."""
    model = SPECS[spec]
    if spec == "lm":
        return 0, model.vocab_size, L
    return (PATCH, model.classes, L + model.class_token) if isinstance(model, ModelSpec) else (D, D, L)


def name(spec: str, loss: str, part: str, dtype: str) -> str:
    return f"{spec}-{loss}-{part}-{dtype}"


def problem(spec: str, loss: str, dtype: str):
    """The block's parameters, X, the loss's target and a direction v, in dtype."""
    dt = DTYPES[dtype]
    params = BlockParams.random(SPECS[spec], d=D, d_k=4, d_ff=7, seed=3, dtype=dt)
    rng = np.random.default_rng(2)
    width_in, width_out, tokens = widths(spec)
    # a language model's ids repeat (the embedding's gradient sums several tokens a row)
    X = (rng.integers(0, 4, size=(B, L)) if spec == "lm" else rng.standard_normal((B, L, width_in)).astype(dt))
    if loss == "mse":
        target = rng.standard_normal((B, tokens, width_out)).astype(dt)
    elif loss == "pooled_cross_entropy":
        target = rng.integers(0, width_out, size=B)
    else:
        target = rng.integers(0, width_out, size=(B, tokens))
        if loss == "next_token":
            target[0, 2] = -100  # an ignored label
    v = rng.standard_normal(params.size).astype(dt)
    return params, X, target, v


def run(lib, spec: str, loss: str, part: str, dtype: str, gpu: int):
    params, X, target, v = problem(spec, loss, dtype)
    dt = DTYPES[dtype]
    validated = _problem(X, target, params, loss, part, SPECS[spec].eps, None, 1)
    core = validated.core_args
    ids = core[0] if spec == "lm" else None
    X = None if spec == "lm" else np.ascontiguousarray(core[0], dtype=dt)  # as the core reads it (a class token's row)
    target = np.ascontiguousarray(core[5] if loss == "mse" else core[6])
    weights = [np.ascontiguousarray(w, dtype=dt) for w in core[2]]
    codes = np.array([int(c) for c in SPECS[spec]._core()], dtype=np.int64)
    shapes = {n.removeprefix("h.0."): s for n, s in zip(params.names, params.shapes)}
    heads = codes[4]
    d_k, d_v = shapes["W_Q"][1] // heads, shapes["W_V"][1] // heads
    d_ff = shapes["W_1"][1] if "W_1" in shapes else 0
    value, grad, hv = np.zeros(1, dt), np.full(params.size, np.nan, dt), np.full(params.size, np.nan, dt)
    message = ctypes.create_string_buffer(512)
    P = ctypes.c_void_p
    table = (P * len(weights))(*[w.ctypes.data for w in weights])
    fn = getattr(lib, "block_loss_hvp_" + dtype)
    fn.restype = ctypes.c_int
    mse = loss == "mse"
    tokens = (ids if X is None else X).shape[1]
    status = fn(ctypes.c_int(gpu), codes.ctypes.data_as(P), ctypes.c_long(B), ctypes.c_long(tokens), ctypes.c_long(D),
                ctypes.c_long(d_k), ctypes.c_long(d_v), ctypes.c_long(d_ff), ctypes.c_double(SPECS[spec].eps),
                P(None) if X is None else X.ctypes.data_as(P), P(None) if ids is None else ids.ctypes.data_as(P),
                table, ctypes.c_long(len(weights)), ctypes.c_int(validated.kind),
                target.ctypes.data_as(P) if mse else P(None), P(None) if mse else target.ctypes.data_as(P),
                ctypes.c_int(PARTS.index(part)), v.ctypes.data_as(P), value.ctypes.data_as(P),
                grad.ctypes.data_as(P), hv.ctypes.data_as(P), message, ctypes.c_long(512))
    if status != 0:
        raise RuntimeError(f"{name(spec, loss, part, dtype)} on {'the GPU' if gpu else 'the host'}: "
                           f"{message.value.decode()}")
    return value, grad, hv


def public(spec: str, loss: str, part: str, dtype: str):
    """The same through blockhess's public functions."""
    params, X, target, v = problem(spec, loss, dtype)
    op = blockhess.hessian_operator(X, target, params, loss=loss, part=part)
    return (np.array([op.loss_value]), blockhess.loss_gradient(X, target, params, loss=loss),
            blockhess.loss_hvp(X, target, params, v, loss=loss, part=part))


# The FFN sublayer's functions (components.hpp): (what, kind, name) with what 0 the output, 1 a
# Jacobian or Kronecker factor (kinds as src/sublayer_shapes.hpp), 2 the cross second derivative.
FFN_L, FFN_D, FFN_F, FFN_E = 4, 3, 5, 2
FFN_CASES = ([(0, 0, "forward")] + [(1, kind, f"jacobian-{kind}") for kind in range(6)]
             + [(2, kind, f"cross-{kind}") for kind in range(2)])


def ffn_name(case: str, dtype: str) -> str:
    return f"ffn-{case}-{dtype}"


def ffn_inputs(dtype: str):
    rng = np.random.default_rng(4)
    dt = DTYPES[dtype]
    return tuple(rng.standard_normal(s).astype(dt) for s in ((FFN_L, FFN_D), (FFN_D, FFN_F), (FFN_F, FFN_E)))


def ffn_size(what: int, kind: int) -> int:
    L, d, f, e = FFN_L, FFN_D, FFN_F, FFN_E
    if what == 0:
        return L * e
    if what == 1:
        return (L * e * d * f, L * e * f * e, L * e * L * d, L * e * d, L * e * f, L * f)[kind]
    return (L * d * f, L * e * d * f * f * e)[kind]


def component_run(lib, sublayer: str, dims: tuple, inputs: tuple, what: int, kind: int, size: int, dtype: str,
                  gpu: int) -> np.ndarray:
    """One of backend_probe.cpp's ffn_component or attention_component into a fresh host array."""
    out = np.full(size, np.nan, DTYPES[dtype])
    message = ctypes.create_string_buffer(512)
    P = ctypes.c_void_p
    status = getattr(lib, f"{sublayer}_component_{dtype}")(
        ctypes.c_int(gpu), *(ctypes.c_long(n) for n in dims), *(a.ctypes.data_as(P) for a in inputs),
        ctypes.c_int(what), ctypes.c_int(kind), out.ctypes.data_as(P), ctypes.c_long(out.size), message,
        ctypes.c_long(512))
    if status != 0:
        raise RuntimeError(f"{sublayer} {what}/{kind} on {'the GPU' if gpu else 'the host'}: {message.value.decode()}")
    return out


def ffn_run(lib, what: int, kind: int, dtype: str, gpu: int) -> np.ndarray:
    return component_run(lib, "ffn", (FFN_L, FFN_D, FFN_F, FFN_E), ffn_inputs(dtype), what, kind, ffn_size(what, kind),
                         dtype, gpu)


def ffn_public(what: int, kind: int, dtype: str) -> np.ndarray:
    """The same through blockhess's public functions."""
    Y, W1, W2 = ffn_inputs(dtype)
    if what == 0:
        result = blockhess.ffn(Y, W1, W2)
    elif what == 2:
        result = blockhess.ffn_cross_hessian(Y, W1, W2, layout=("blocks", "dense")[kind])
    elif kind < 4:
        wrt, layout = (("W_1", "dense"), ("W_2", "dense"), ("Y", "dense"), ("Y", "blocks"))[kind]
        result = blockhess.ffn_jacobian(Y, W1, W2, wrt, layout=layout)
    else:  # the factor that is not the input: V of W_1's, U of W_2's
        U, V = blockhess.ffn_jacobian(Y, W1, W2, ("W_1", "W_2")[kind - 4], layout="kron")
        result = V if kind == 4 else U
    return np.asarray(result).reshape(-1)


# The attention's functions (components.hpp): (what, kind, name) with what 0 the output, 1 its
# Jacobian with respect to W_Q, W_K, W_V or X (kind 0..3, as src/sublayer_shapes.hpp).
ATTENTION_L, ATTENTION_D, ATTENTION_DK, ATTENTION_DV = 4, 3, 2, 5
ATTENTION_WRT = ("W_Q", "W_K", "W_V", "X")
ATTENTION_CASES = [(0, 0, "forward")] + [(1, kind, f"jacobian-{wrt}") for kind, wrt in enumerate(ATTENTION_WRT)]


def attention_name(case: str, dtype: str) -> str:
    return f"attention-{case}-{dtype}"


def attention_inputs(dtype: str):
    rng = np.random.default_rng(6)
    L, d, dk, dv = ATTENTION_L, ATTENTION_D, ATTENTION_DK, ATTENTION_DV
    return tuple(rng.standard_normal(s).astype(DTYPES[dtype]) for s in ((L, d), (d, dk), (d, dk), (d, dv)))


def attention_run(lib, what: int, kind: int, dtype: str, gpu: int) -> np.ndarray:
    L, d, dk, dv = dims = (ATTENTION_L, ATTENTION_D, ATTENTION_DK, ATTENTION_DV)
    size = L * dv * (1 if what == 0 else (d * dk, d * dk, d * dv, L * d)[kind])
    return component_run(lib, "attention", dims, attention_inputs(dtype), what, kind, size, dtype, gpu)


def attention_public(what: int, kind: int, dtype: str) -> np.ndarray:
    """The same through blockhess's public functions."""
    X, WQ, WK, WV = attention_inputs(dtype)
    if what == 0:
        return np.asarray(blockhess.attention(X, WQ, WK, WV)).reshape(-1)
    return np.asarray(blockhess.attention_jacobian(X, WQ, WK, WV, ATTENTION_WRT[kind])).reshape(-1)


# Blocks whose Jacobians run on the GPU backend, every parameter's (a pre-LN block's first norm's
# factors mixed by the attention there too), and a language model's: from the factors that reach
# its LM head (the final norm's, the upper layer's, the lower layer's norm and biases: vec [1],
# mixed by the upper attention; b_Q's right factor applied there and kept on the residual path),
# else a forward tangent per entry (a lower layer's weight, the positions, the tied embedding).
JACOBIAN_SPECS = ("paper", "gpt2", "rmsnorm", "attention_only")
MODEL_JACOBIANS = {"lm": ("ln_f.gamma", "ln_f.beta", "h.1.W_1", "h.1.b_Q", "h.0.gamma_1", "h.0.b_Q", "h.0.b_V",
                          "h.0.W_1", "wpe", "wte")}
REFUSED = "the nodes' curvature terms runs on the host so far"


def jacobian_keys():
    """(spec, parameter) of every Jacobian case."""
    return ([(spec, name) for spec in JACOBIAN_SPECS
             for name in BlockParams.random(SPECS[spec], d=D, d_k=4, d_ff=7).names]
            + [(spec, name) for spec, names in MODEL_JACOBIANS.items() for name in names])


def jacobian_run(lib, spec: str, param: str, dtype: str, gpu: int):
    """dZ/dW of one sample through backend_probe.cpp's block_jacobian and blockhess.block_jacobian."""
    dt = DTYPES[dtype]
    params = BlockParams.random(SPECS[spec], d=D, d_k=4, d_ff=7, seed=3, dtype=dt)
    rng = np.random.default_rng(5)
    X = rng.integers(0, 4, size=L) if spec == "lm" else rng.standard_normal((L, D)).astype(dt)
    X3, weights, _, _ = _batch(X, params, single=True)
    ids = X3 if spec == "lm" else None
    codes = np.array([int(c) for c in SPECS[spec]._core()], dtype=np.int64)
    shapes = {n.removeprefix("h.0."): s for n, s in zip(params.names, params.shapes)}
    heads = codes[4]
    p = list(params.names).index(param)
    width = SPECS[spec].vocab_size if spec == "lm" else D
    J = np.full((L * width, weights[p].size), np.nan, dt)
    message = ctypes.create_string_buffer(512)
    P = ctypes.c_void_p
    table = (P * len(weights))(*[w.ctypes.data for w in weights])
    status = getattr(lib, "block_jacobian_" + dtype)(
        ctypes.c_int(gpu), codes.ctypes.data_as(P), ctypes.c_long(L), ctypes.c_long(D),
        ctypes.c_long(shapes["W_Q"][1] // heads), ctypes.c_long(shapes["W_V"][1] // heads),
        ctypes.c_long(shapes["W_1"][1] if "W_1" in shapes else 0), ctypes.c_double(SPECS[spec].eps),
        P(None) if ids is not None else X3.ctypes.data_as(P), P(None) if ids is None else ids.ctypes.data_as(P),
        table, ctypes.c_long(len(weights)), ctypes.c_int(p), J.ctypes.data_as(P), ctypes.c_long(J.size), message,
        ctypes.c_long(512))
    if status != 0:
        raise RuntimeError(f"the Jacobian of {spec} by {param} on {'the GPU' if gpu else 'the host'}: "
                           f"{message.value.decode()}")
    public = blockhess.block_jacobian(X, params, param)
    return J, np.asarray(public)


def main(library: str, out: str) -> None:
    lib = ctypes.CDLL(library)
    results = {}
    for spec, param in jacobian_keys():
        for dtype in DTYPES:
            on_host, by_public = jacobian_run(lib, spec, param, dtype, 0)
            on_gpu = jacobian_run(lib, spec, param, dtype, 1)
            key = f"jacobian-{spec}-{param}-{dtype}"
            results[f"{key}/host"], results[f"{key}/public"] = on_host, by_public
            results[f"{key}/gpu"] = on_gpu[0]
    for cases, key, run_on, public_of in ((FFN_CASES, ffn_name, ffn_run, ffn_public),
                                          (ATTENTION_CASES, attention_name, attention_run, attention_public)):
        for what, kind, case in cases:
            for dtype in DTYPES:
                for where, gpu in (("host", 0), ("gpu", 1)):
                    results[f"{key(case, dtype)}/{where}"] = run_on(lib, what, kind, dtype, gpu)
                results[f"{key(case, dtype)}/public"] = public_of(what, kind, dtype)
    for case in CASES:
        for where, gpu in (("host", 0), ("gpu", 1)):
            for what, array in zip(("value", "grad", "hv"), run(lib, *case, gpu)):
                results[f"{name(*case)}/{where}/{what}"] = array
        for what, array in zip(("value", "grad", "hv"), public(*case)):
            results[f"{name(*case)}/public/{what}"] = np.asarray(array)
    np.savez(out, **results)


if __name__ == "__main__":
    main(*sys.argv[1:])
