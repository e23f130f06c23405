"""The CPU workloads: each :class:`~._harness.Bench` below lists the methods that compute one
mathematical object (blockhess, PyTorch autograd, floors) and how each is built. ``BENCHES`` maps
their names to them (asv's bench_*.py files and ``benchmarks/report.py`` use the same ones)."""

from __future__ import annotations

import numpy as np

from . import _torch_methods as tm
from ._data import attention_inputs, block_inputs, block_jacobian_stand_in, ffn_inputs, layernorm_input
from ._harness import Bench, Method, WeightJacobian, blockhess_api, check_dense, floor_zeros, rel_error
from ._settings import ATTENTION_SHAPES, BLOCK_SHAPES, EPS, FFN_SHAPES, LN_HESSIAN_SHAPES, LN_JACOBIAN_SHAPES
from ._torch_methods import as_tensor, torch


class LayerNormJacobian(Bench):
    name = "ln_jacobian"
    title = "LayerNorm Jacobian"
    short = "LN Jac"
    param_names = ("shape",)
    params = (LN_JACOBIAN_SHAPES,)
    methods = (
        Method("blockhess_dense", "blockhess dense", "ours", "dense", "dense"),
        Method("blockhess_blocks", "blockhess blocks", "ours", "blocks", "blocks"),
        Method("jacrev_dense", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("vmap_jacrev_blocks", "vmap(jacrev) over rows", "torch", "blocks", "vmap(jacrev)"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor_dense", "floor: allocate+zero dense", "floor", "dense"),
        Method("floor_blocks", "floor: allocate+zero blocks", "floor", "blocks"),
    )

    @staticmethod
    def inputs(shape):
        return layernorm_input(shape, 1)

    def _blockhess_dense(self, shape):
        f = blockhess_api("layernorm_jacobian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="dense")

    def _blockhess_blocks(self, shape):
        f = blockhess_api("layernorm_jacobian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="blocks")

    def _jacrev_dense(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        n = X.numel()
        jac = t.func.jacrev(tm.layernorm)
        return lambda: jac(X).reshape(n, n)

    def _vmap_jacrev_blocks(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        jac = t.func.vmap(t.func.jacrev(tm.layernorm))
        return lambda: jac(X)

    def _autograd_jacobian(self, shape):
        if shape != LN_JACOBIAN_SHAPES[0]:
            raise NotImplementedError("autograd.functional.jacobian takes minutes here; small size only")
        t = torch()
        X = as_tensor(self.inputs(shape))
        n = X.numel()
        return lambda: t.autograd.functional.jacobian(tm.layernorm, X).reshape(n, n)

    def _floor_dense(self, shape):
        n = shape[0] * shape[1]
        return floor_zeros((n, n))

    def _floor_blocks(self, shape):
        L, d = shape
        return floor_zeros((L, d, d))


class LayerNormHessian(Bench):
    name = "ln_hessian"
    title = "LayerNorm second derivative"
    short = "LN Hess"
    param_names = ("shape",)
    params = (LN_HESSIAN_SHAPES,)
    methods = (
        Method("blockhess_dense", "blockhess dense", "ours", "dense", "dense"),
        Method("blockhess_blocks", "blockhess blocks", "ours", "blocks", "blocks"),
        Method("hessian_dense", "torch.func.hessian", "torch", "dense", "hessian"),
        Method("vmap_hessian_blocks", "vmap(hessian) over rows", "torch", "blocks", "vmap(hessian)"),
        Method("floor_dense", "floor: allocate+zero dense", "floor", "dense"),
        Method("floor_blocks", "floor: allocate+zero blocks", "floor", "blocks"),
    )

    @staticmethod
    def inputs(shape):
        return layernorm_input(shape, 2)

    @staticmethod
    def dense_shape(shape):
        n = shape[0] * shape[1]
        return (n * n, n)

    def _blockhess_dense(self, shape):
        f = blockhess_api("layernorm_hessian")
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="dense")

    def _blockhess_blocks(self, shape):
        f = blockhess_api("layernorm_hessian")
        X = self.inputs(shape)
        return lambda: f(X, eps=EPS, layout="blocks")

    def _hessian_dense(self, shape):
        t = torch()
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        X = as_tensor(self.inputs(shape))
        hess = t.func.hessian(tm.layernorm)
        out_shape = self.dense_shape(shape)
        return lambda: hess(X).reshape(out_shape)

    def _vmap_hessian_blocks(self, shape):
        t = torch()
        X = as_tensor(self.inputs(shape))
        hess = t.func.vmap(t.func.hessian(tm.layernorm))
        return lambda: hess(X)

    def _floor_dense(self, shape):
        check_dense(self.dense_shape(shape), "the dense LayerNorm second derivative")
        return floor_zeros(self.dense_shape(shape))

    def _floor_blocks(self, shape):
        L, d = shape
        return floor_zeros((L, d, d, d))


class FFNJacobian(WeightJacobian):
    name = "ffn_jacobian"
    title = "FFN Jacobian"
    short = "FFN Jac"
    param_names = ("wrt", "shape")
    params = (["W_1", "W_2"], FFN_SHAPES)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("blockhess_kron", "blockhess Kronecker factors", "ours", "kron", "kron factors"),
        Method("jacrev", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor", "floor: allocate+zero", "floor", "dense"),
    )

    inputs = staticmethod(ffn_inputs)

    def _blockhess_kron(self, wrt, shape):
        f = blockhess_api("ffn_jacobian")
        Y, W1, W2 = self.inputs(shape)
        return lambda: f(Y, W1, W2, wrt, layout="kron")

    def densify(self, layout, out, wrt, shape):
        """The Kronecker factors (U, V) rebuild the dense Jacobian."""
        U, V = out
        return np.einsum("tp,tcq->tcpq", U, V).reshape(self.out_shape(wrt, shape))

    def rel_error(self, method, *params):
        if method != "blockhess_kron":
            return super().rel_error(method, *params)
        return rel_error(self.densify("kron", self.build(method, *params)(), *params),
                         self.build("jacrev", *params)())

    @staticmethod
    def out_shape(wrt, shape):
        L, d, dff = shape
        return (L * d, d * dff)  # W_1 is (d, d_ff), W_2 is (d_ff, d): same size

    def _blockhess(self, wrt, shape):
        f = blockhess_api("ffn_jacobian")
        Y, W1, W2 = self.inputs(shape)
        return lambda: f(Y, W1, W2, wrt)

    def _torch_fn(self, wrt, shape):
        Y, W1, W2 = (as_tensor(a) for a in self.inputs(shape))
        if wrt == "W_1":
            return (lambda W: tm.ffn(Y, W, W2)), W1
        return (lambda W: tm.ffn(Y, W1, W)), W2


class AttentionJacobian(WeightJacobian):
    name = "attention_jacobian"
    title = "Attention Jacobian"
    short = "Attn Jac"
    param_names = ("wrt", "shape")
    params = (["W_Q", "W_K", "W_V"], ATTENTION_SHAPES)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("jacrev", "torch.func.jacrev", "torch", "dense", "jacrev"),
        Method("autograd_jacobian", "autograd.functional.jacobian", "torch", "dense", "autograd.jacobian"),
        Method("floor", "floor: allocate+zero", "floor", "dense"),
    )

    inputs = staticmethod(attention_inputs)

    @staticmethod
    def out_shape(wrt, shape):
        L, d, dk = shape
        return (L * d, d * (d if wrt == "W_V" else dk))

    def _blockhess(self, wrt, shape):
        f = blockhess_api("attention_jacobian")
        X, WQ, WK, WV = self.inputs(shape)
        return lambda: f(X, WQ, WK, WV, wrt)

    def _torch_fn(self, wrt, shape):
        X, WQ, WK, WV = (as_tensor(a) for a in self.inputs(shape))
        if wrt == "W_Q":
            return (lambda W: tm.attention(X, W, WK, WV)), WQ
        if wrt == "W_K":
            return (lambda W: tm.attention(X, WQ, W, WV)), WK
        return (lambda W: tm.attention(X, WQ, WK, W)), WV


class BlockLossHessian(Bench):
    name = "block_hessian"
    title = "Full block loss Hessian (MSE)"
    short = "Block Hess"
    param_names = ("shape",)
    params = (BLOCK_SHAPES,)
    methods = (
        Method("blockhess", "blockhess", "ours", "dense", "blockhess"),
        Method("hessian", "torch.func.hessian", "torch", "dense", "hessian"),
        Method("autograd_hessian", "autograd.functional.hessian(vectorize=True)", "torch", "dense", "autograd.hessian"),
        Method("floor_gemm", "floor: numpy J^T J GEMM", "floor", "dense", "J^T J GEMM floor"),
        Method("floor_zeros", "floor: allocate+zero", "floor", "dense"),
    )

    @staticmethod
    def sizes(shape):
        L, d, dk, dff = shape
        return [d * dk, d * dk, d * d, d * dff, dff * d]

    @classmethod
    def num_params(cls, shape) -> int:
        return sum(cls.sizes(shape))

    inputs = staticmethod(block_inputs)

    def _blockhess(self, shape):
        BlockParams, loss_hessian = blockhess_api("BlockParams", "loss_hessian")
        X, target, W = self.inputs(shape)
        params = BlockParams(*W)
        return lambda: loss_hessian(X, target, params, loss="mse", part="full", layout="dense")

    def _torch_loss(self, shape):
        X, target, W = self.inputs(shape)
        return tm.block_mse_of_flat(X, target, W)

    def _hessian(self, shape):
        t = torch()
        loss, w0 = self._torch_loss(shape)
        hess = t.func.hessian(loss)
        return lambda: hess(w0)

    def _autograd_hessian(self, shape):
        t = torch()
        loss, w0 = self._torch_loss(shape)
        return lambda: t.autograd.functional.hessian(loss, w0, vectorize=True)

    def _floor_gemm(self, shape):
        J = block_jacobian_stand_in(shape, self.num_params(shape))
        return lambda: J.T @ J

    def _floor_zeros(self, shape):
        P = self.num_params(shape)
        return floor_zeros((P, P))


LN_JACOBIAN = LayerNormJacobian()
LN_HESSIAN = LayerNormHessian()
FFN_JACOBIAN = FFNJacobian()
ATTENTION_JACOBIAN = AttentionJacobian()
BLOCK_HESSIAN = BlockLossHessian()
BENCHES = {b.name: b for b in (LN_JACOBIAN, LN_HESSIAN, FFN_JACOBIAN, ATTENTION_JACOBIAN, BLOCK_HESSIAN)}
