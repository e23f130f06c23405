"""Full post-LN block loss Hessian (all five weight matrices, MSE): blockhess vs torch.func.hessian vs
autograd.functional.hessian(vectorize=True), plus the numpy J^T J GEMM and allocate-and-zero floors."""

import numpy as np

from ._harness import blockhess_api
from ._peak_memory import peak_memory
from ._workloads import BLOCK_HESSIAN


class TimeBlockLossHessian:
    params = (BLOCK_HESSIAN.method_names, *BLOCK_HESSIAN.params)
    param_names = ("method", *BLOCK_HESSIAN.param_names)
    rounds = 1
    repeat = (2, 6, 10.0)
    warmup_time = 0.5
    timeout = 600

    def setup(self, method, shape):
        self.fn = BLOCK_HESSIAN.build(method, shape)

    def time_block_loss_hessian(self, method, shape):
        self.fn()


class TimeBlockLossHessianIntoOut:
    """blockhess with out=: the same Hessian written into one preallocated array on every call (the
    allocation and first-touch page faults of a fresh result are what this saves)."""

    params = BLOCK_HESSIAN.params
    param_names = BLOCK_HESSIAN.param_names
    rounds = 1
    repeat = (2, 6, 10.0)
    warmup_time = 0.5
    timeout = 600

    def setup(self, shape):
        BlockParams, loss_hessian = blockhess_api("BlockParams", "loss_hessian")
        X, target, W = BLOCK_HESSIAN.inputs(shape)
        params = BlockParams(*W)
        out = np.empty((params.size, params.size))
        self.fn = lambda: loss_hessian(X, target, params, loss="mse", out=out)
        self.fn()

    def time_block_loss_hessian_into_out(self, shape):
        self.fn()


class AccuracyBlockLossHessian:
    params = BLOCK_HESSIAN.params
    param_names = BLOCK_HESSIAN.param_names
    timeout = 600

    def setup(self, shape):
        BLOCK_HESSIAN.build("blockhess", shape)
        BLOCK_HESSIAN.build("hessian", shape)

    def track_rel_error(self, shape):
        return BLOCK_HESSIAN.rel_error("blockhess", shape)

    track_rel_error.unit = "relative error"


class MemBlockLossHessian:
    """Process peak RSS around one full Hessian (includes the interpreter and, for torch, PyTorch)."""

    params = (["blockhess", "hessian"], *BLOCK_HESSIAN.params)
    param_names = ("method", *BLOCK_HESSIAN.param_names)
    timeout = 600

    def setup(self, method, shape):
        self.fn = BLOCK_HESSIAN.build(method, shape)

    def peakmem_block_loss_hessian(self, method, shape):
        self.fn()


class MemRatioBlockLossHessian:
    """Peak RSS increase of one blockhess full Hessian call, in units of its output size, measured in a
    fresh process (target: <= 2 plus O(L d max n_i) bytes)."""

    params = BLOCK_HESSIAN.params
    param_names = BLOCK_HESSIAN.param_names
    timeout = 600

    def setup(self, shape):
        BLOCK_HESSIAN.build("blockhess", shape)

    def track_peak_increase_over_output(self, shape):
        m = peak_memory("block_hessian", "blockhess", shape)
        return (m["peak"] - m["base"]) / m["nbytes"]

    track_peak_increase_over_output.unit = "x output size"
