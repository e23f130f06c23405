"""What every CPU benchmark is built on: :class:`Bench`, a list of *methods* (blockhess, PyTorch
autograd formulations and "floors") that all compute the same mathematical object on identical
inputs, and the helpers its methods share.

``Bench.build(method, *params)`` prepares the inputs (untimed) and returns a zero-argument callable
that does the timed work and returns its output. It raises ``NotImplementedError`` when the method
cannot run: the blockhess API is missing at this commit, or the size is infeasible for that method
(asv then skips the combination; the report prints "n/a").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import _settings
from ._torch_methods import torch


def blockhess_api(*names: str):
    """The named blockhess attributes, or NotImplementedError if this commit lacks any of them."""
    if _settings.TORCH_FIRST:
        try:
            torch()
        except NotImplementedError:
            pass
    try:
        import blockhess
    except ImportError as err:  # pragma: no cover
        raise NotImplementedError(f"blockhess does not import: {err}") from err
    found = []
    for name in names:
        obj = getattr(blockhess, name, None)
        if obj is None:
            raise NotImplementedError(f"blockhess.{name} is not available at this commit")
        found.append(obj)
    return found[0] if len(found) == 1 else tuple(found)


def to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def rel_error(a, b) -> float:
    """||a - b||_F / ||b||_F (b is the autograd reference)."""
    a = np.asarray(to_numpy(a), dtype=np.float64)
    b = np.asarray(to_numpy(b), dtype=np.float64)
    if a.size != b.size:
        raise ValueError(f"cannot compare outputs of shapes {a.shape} and {b.shape}")
    a = a.reshape(b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def floor_zeros(shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    """Allocate-and-zero floor: the least work any method returning a fresh array of `shape` does."""

    def run():
        out = np.zeros(shape)
        out.fill(0.0)  # touch every page: np.zeros alone maps lazily-zeroed pages
        return out

    return run


def check_dense(shape: tuple[int, ...], what: str) -> None:
    nbytes = 8 * math.prod(shape)
    if nbytes > _settings.DENSE_LIMIT_BYTES:
        raise NotImplementedError(f"{what} would be {nbytes / 2**30:.1f} GiB; skipped on this machine")


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # human-readable, for the report
    kind: str  # "ours" | "torch" | "floor"
    layout: str  # methods with the same layout produce the same array (up to reshape)
    short: str = ""  # for the chart; defaults to label

    @property
    def chart_label(self) -> str:
        return self.short or self.label


class Bench:
    name = ""
    title = ""
    short = ""  # for the chart
    param_names: tuple[str, ...] = ()
    params: tuple[list, ...] = ()
    methods: tuple[Method, ...] = ()

    def method(self, name: str) -> Method:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def method_names(self) -> list[str]:
        return [m.name for m in self.methods]

    def ours(self, layout: str) -> str | None:
        """The blockhess method producing `layout` (the baseline of the ratios)."""
        for m in self.methods:
            if m.kind == "ours" and m.layout == layout:
                return m.name
        return None

    def reference(self, layout: str) -> str | None:
        """The autograd method whose output the blockhess method of `layout` is checked against."""
        for m in self.methods:
            if m.kind == "torch" and m.layout == layout:
                return m.name
        return None

    def build(self, method: str, *params) -> Callable[[], object]:
        if method not in self.method_names:
            raise ValueError(f"{self.name}: unknown method {method!r}")
        return getattr(self, "_" + method)(*params)

    def densify(self, layout: str, out, *params):
        """The dense array a structured output stands for (benches with such layouts override)."""
        raise NotImplementedError(f"{self.name}: no dense form of layout {layout!r}")

    def rel_error(self, method: str, *params) -> float:
        """Relative error of a blockhess method against the autograd reference of the same layout."""
        ref = self.reference(self.method(method).layout)
        if ref is None:
            raise NotImplementedError(f"{self.name}: no autograd reference for {method}")
        return rel_error(self.build(method, *params)(), self.build(ref, *params)())


class WeightJacobian(Bench):
    """Jacobians with respect to one weight matrix; subclasses give inputs, out_shape, _torch_fn."""

    def _jacrev(self, wrt, shape):
        t = torch()
        fn, W = self._torch_fn(wrt, shape)
        jac = t.func.jacrev(fn)
        out = self.out_shape(wrt, shape)
        return lambda: jac(W).reshape(out)

    def _autograd_jacobian(self, wrt, shape):
        t = torch()
        fn, W = self._torch_fn(wrt, shape)
        out = self.out_shape(wrt, shape)
        return lambda: t.autograd.functional.jacobian(fn, W).reshape(out)

    def _floor(self, wrt, shape):
        return floor_zeros(self.out_shape(wrt, shape))
