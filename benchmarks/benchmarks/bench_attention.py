"""Attention Jacobians w.r.t. W_Q, W_K, W_V: blockhess vs PyTorch autograd vs the allocation floor."""

from ._workloads import ATTENTION_JACOBIAN


class TimeAttentionJacobian:
    params = (ATTENTION_JACOBIAN.method_names, *ATTENTION_JACOBIAN.params)
    param_names = ("method", *ATTENTION_JACOBIAN.param_names)
    rounds = 1
    repeat = (2, 10, 10.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, method, wrt, shape):
        self.fn = ATTENTION_JACOBIAN.build(method, wrt, shape)

    def time_attention_jacobian(self, method, wrt, shape):
        self.fn()


class AccuracyAttentionJacobian:
    params = ATTENTION_JACOBIAN.params
    param_names = ATTENTION_JACOBIAN.param_names
    timeout = 300

    def setup(self, wrt, shape):
        ATTENTION_JACOBIAN.build("blockhess", wrt, shape)
        ATTENTION_JACOBIAN.build("jacrev", wrt, shape)

    def track_rel_error(self, wrt, shape):
        return ATTENTION_JACOBIAN.rel_error("blockhess", wrt, shape)

    track_rel_error.unit = "relative error"
