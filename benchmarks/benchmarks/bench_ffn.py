"""FFN Jacobians w.r.t. W_1 and W_2: blockhess vs PyTorch autograd vs the allocation floor."""

from ._workloads import FFN_JACOBIAN


class TimeFFNJacobian:
    params = (FFN_JACOBIAN.method_names, *FFN_JACOBIAN.params)
    param_names = ("method", *FFN_JACOBIAN.param_names)
    rounds = 1
    repeat = (2, 10, 10.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, method, wrt, shape):
        self.fn = FFN_JACOBIAN.build(method, wrt, shape)

    def time_ffn_jacobian(self, method, wrt, shape):
        self.fn()


class AccuracyFFNJacobian:
    params = FFN_JACOBIAN.params
    param_names = FFN_JACOBIAN.param_names
    timeout = 300

    def setup(self, wrt, shape):
        FFN_JACOBIAN.build("blockhess", wrt, shape)
        FFN_JACOBIAN.build("jacrev", wrt, shape)

    def track_rel_error(self, wrt, shape):
        return FFN_JACOBIAN.rel_error("blockhess", wrt, shape)

    track_rel_error.unit = "relative error"
