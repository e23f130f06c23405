"""LayerNorm Jacobian and second derivative: blockhess vs PyTorch autograd vs the allocation floor."""

from ._workloads import LN_HESSIAN, LN_JACOBIAN


class TimeLayerNormJacobian:
    params = (LN_JACOBIAN.method_names, *LN_JACOBIAN.params)
    param_names = ("method", *LN_JACOBIAN.param_names)
    rounds = 1
    repeat = (2, 10, 10.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, method, shape):
        self.fn = LN_JACOBIAN.build(method, shape)

    def time_layernorm_jacobian(self, method, shape):
        self.fn()


class TimeLayerNormHessian:
    params = (LN_HESSIAN.method_names, *LN_HESSIAN.params)
    param_names = ("method", *LN_HESSIAN.param_names)
    rounds = 1
    repeat = (2, 10, 10.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, method, shape):
        self.fn = LN_HESSIAN.build(method, shape)

    def time_layernorm_hessian(self, method, shape):
        self.fn()


class AccuracyLayerNormJacobian:
    params = (["blockhess_dense", "blockhess_blocks"], *LN_JACOBIAN.params)
    param_names = ("method", *LN_JACOBIAN.param_names)
    timeout = 300

    def setup(self, method, shape):
        LN_JACOBIAN.build(method, shape)
        LN_JACOBIAN.build(LN_JACOBIAN.reference(LN_JACOBIAN.method(method).layout), shape)

    def track_rel_error(self, method, shape):
        return LN_JACOBIAN.rel_error(method, shape)

    track_rel_error.unit = "relative error"


class AccuracyLayerNormHessian:
    params = (["blockhess_dense", "blockhess_blocks"], *LN_HESSIAN.params)
    param_names = ("method", *LN_HESSIAN.param_names)
    timeout = 300

    def setup(self, method, shape):
        LN_HESSIAN.build(method, shape)
        LN_HESSIAN.build(LN_HESSIAN.reference(LN_HESSIAN.method(method).layout), shape)

    def track_rel_error(self, method, shape):
        return LN_HESSIAN.rel_error(method, shape)

    track_rel_error.unit = "relative error"
