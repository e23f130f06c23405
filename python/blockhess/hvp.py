"""Matrix-free curvature of the block's loss: exact Hessian-vector products, and the Hessian as a
linear operator, without ever forming the (P, P) matrix.

The product is closed form (forward over reverse in the C++ core, see engine/loss.hpp): no autograd,
no finite differences, memory O(B L (L + d + d_ff)) plus the vectors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from . import _backend, _core, _gpu_launch
from ._curvature_operator import CurvatureOperator
from ._interop import holds_torch, returns_callers_kind
from ._validate import choice, contiguous, float_array, require_output_fits
from .block import _PARTS, BlockParams, _loss_inputs, _selected_sizes, _selection, _sizes, _working
from .spec import loss_names


# The most products an exact diagonal may take where the per-token factors do not reach a selected
# parameter (one per parameter, docs/derivation.md §5.4); above it, diagonal() and trace() refuse and
# name the estimate (exact=False).
EXACT_PRODUCTS_LIMIT = 65_536


class HessianOperator(CurvatureOperator):
    """The loss Hessian (or its outer / functional part) over the parameters in ``wrt`` as a
    linear operator of shape (P, P). Built by :func:`hessian_operator`; the forward and reverse
    passes are computed once, so each product costs only the product.

    ``op @ v``, ``op.matvec(v)`` for v of shape (P,), ``op.matmat(V)`` for V of shape (P, k). Vectors
    are converted to the operator's dtype; results are NumPy arrays, torch tensors for torch
    inputs, and on the device for GPU vectors: for a model that reads X under mse or cross_entropy the
    engine runs on the GPU (docs/backends.md), otherwise it computes them from host copies.
    ``op.to_scipy()`` gives a ``scipy.sparse.linalg.LinearOperator`` (for ``eigsh``, ``cg``),
    ``op.to_cupyx()`` its ``cupyx.scipy.sparse.linalg`` twin over GPU vectors.

    Curvature without a dense matrix: :meth:`diagonal`, :meth:`trace` (whole or per parameter) exact
    from the per-token factors (or, for a model's lower layers, from one product per parameter), or
    estimated with their standard errors (exact=False); :meth:`eigsh` (extreme eigenvalues by
    Lanczos through H v) and :meth:`spectral_density` (stochastic Lanczos quadrature). The diagonal and eigsh's results are
    torch tensors when the operator was built from tensors.

    The operator keeps its own copies of the inputs: every method answers for X, the target, the
    weights and the head as they were when it was built, whatever the caller changes later.
    """

    def __init__(self, problem: _Problem, from_torch: bool = False, device: Any = None) -> None:
        self._op = None  # the host engine's operator, built on first use (_host_operator)
        # The GPU engine's, for a problem it runs (its passes done now, on the current stream).
        self._gpu_op = None
        if problem.gpu_args is not None:
            with _backend.device_of(device):
                self._gpu_op = _gpu_launch.engine_hessian_operator(*problem.gpu_args)
        self._problem = problem
        self.dtype = problem.dtype
        self.names = problem.names
        self.part = problem.part
        self.loss = problem.loss
        self.shape = (problem.P, problem.P)
        self._sizes = _selected_sizes(problem.params, problem.names)  # of the parameters in names
        self._from_torch = from_torch
        self._device = device
        self._diagonal = None

    def _compute_diagonal(self) -> np.ndarray:
        problem, params = self._problem, self._problem.params
        B, L, _ = _sizes(problem.X3, params)
        working = _working(params, B, L, problem.dtype.itemsize, "diagonal", kind=problem.kind, head=problem.head,
                           part_code=_PARTS[problem.part], selected=problem.selected)
        require_output_fits((problem.P,), problem.dtype,
                            f"the Hessian's diagonal over {', '.join(problem.names)} (P = {problem.P})",
                            "pass wrt=(...) with fewer parameters, or fewer samples or tokens",
                            working=working)
        out = np.empty(problem.P, dtype=problem.dtype)
        _core.loss_hessian_diagonal(*problem.core_args, out, EXACT_PRODUCTS_LIMIT, *problem.head)
        return out

    def _product_working(self, columns: int) -> int:
        return _products_working(self._problem, columns)

    def _host_operator(self) -> Any:
        """The host engine's operator over host copies of the inputs (for host vectors)."""
        if self._op is None:
            problem = self._problem
            core_class = _core.HessianOperator64 if problem.dtype == np.float64 else _core.HessianOperator32
            self._op = core_class(*problem.core_args, *problem.head)
        return self._op

    @property
    def loss_value(self) -> float:
        """The loss at the point where the Hessian is taken."""
        return float((self._gpu_op if self._gpu_op is not None else self._host_operator()).loss_value)

    def __repr__(self) -> str:
        return (f"HessianOperator(shape={self.shape}, dtype={self.dtype}, loss={self.loss!r}, "
                f"part={self.part!r}, wrt={self.names})")

    def _product(self, V: Any) -> np.ndarray:
        """H V for V already checked by float_array (dtype, NaN), in the operator's dtype."""
        V = _vectors(V, self.shape[0], self.names, self.dtype)
        out = np.empty(V.shape, dtype=self.dtype)
        self._host_operator().apply(V, out)
        return out

    def _device_product(self, V: Any) -> Any:
        """H V for a GPU V on the GPU engine (None where it does not run this problem)."""
        if self._gpu_op is None:
            return None
        return _on_gpu(V, self.shape[0], self.names, self.dtype,
                       lambda rows, out: _gpu_launch.engine_operator_apply(self._gpu_op, rows, out))


def _require_rows(V: Any, P: int, names: tuple[str, ...]) -> None:
    """V (P,) or (P, k): one row per selected parameter entry."""
    if V.shape[0] != P:
        what = "V" if V.ndim == 2 else "v"
        raise ValueError(f"{what} must have {P} rows (the parameters in wrt={names}), got shape {tuple(V.shape)}")


def _vectors(V: np.ndarray, P: int, names: tuple[str, ...], dtype: np.dtype) -> np.ndarray:
    """V (checked by float_array) as the C-contiguous (P,) or (P, k) array of dtype a product takes."""
    _require_rows(V, P, names)
    return contiguous(V, dtype)


def _on_gpu(V: Any, P: int, names: tuple[str, ...], dtype: np.dtype, products: Any) -> Any:
    """H V for a GPU V (P,) or (P, k) by products(rows, out), which writes out (k, P) = the products of
    the rows (k, P) of V^T, on V's device."""
    _require_rows(V, P, names)
    xp = _backend.array_module(V)
    with _backend.device_of(V):
        rows = xp.ascontiguousarray((V if V.ndim == 2 else V[:, None]).T, dtype=dtype)
        out = xp.empty_like(rows)
        products(rows, out)
        return out[0] if V.ndim == 1 else xp.ascontiguousarray(out.T)


def hessian_operator(
    X: Any,
    target: Any,
    params: BlockParams,
    *,
    loss: str = "mse",
    part: str = "full",
    eps: float | None = None,
    wrt: tuple[str, ...] | None = None,
    head: Any = None,
) -> HessianOperator:
    """The exact loss Hessian as a linear operator, for Hessian-vector products at sizes where the
    dense (P, P) matrix would not fit. Arguments as in :func:`blockhess.loss_hessian`. The operator
    answers for the arguments as they are now (it keeps copies)."""
    problem = _kept(_problem(X, target, params, loss, part, eps, wrt, columns=1, head=head))
    operator = HessianOperator(problem, from_torch=holds_torch(X, target, params, head), device=problem.device)
    if problem.gpu_args is None:
        operator._host_operator()  # its passes now, as the GPU's run at construction
    return operator


class _Problem(NamedTuple):
    """A loss-Hessian call's inputs, validated and in one dtype, with its core arguments."""

    params: BlockParams
    X3: np.ndarray
    dtype: np.dtype
    kind: int
    loss: str
    part: str
    names: tuple[str, ...]
    selected: list[bool]
    P: int
    core_args: tuple  # X, spec, weights, eps, kind, values, classes, part, selection (host arrays)
    head: tuple
    device: Any  # for GPU inputs, X as given (its device gets the results), else None
    gpu_args: tuple | None  # the same (and the head) on the device for GPU inputs, else None


def _problem(X, target, params, loss, part, eps, wrt, columns, promote_with=(), head=None) -> _Problem:
    params, X3, W, dtype, eps, kind, values, classes, head = _loss_inputs(X, target, params, loss, eps,
                                                                          promote_with, head=head)
    loss = loss_names()[kind]  # the name _loss_inputs validated
    part = choice(part, "part", tuple(_PARTS))
    names, selected, P = _selection(params, wrt)
    # GPU arrays: the engine runs the products on the GPU (gpu_args); the exact diagonal on host
    # copies, its result copied to the device.
    device = X3 if _backend.on_device(X3) else None
    gpu_args = None
    if device is not None:
        gpu_args = (X3, params.spec._core(), W, eps, kind, values, classes, head, _PARTS[part], selected)
    X3, values, classes = (_backend.to_host(a) for a in (X3, values, classes))
    W, head = [_backend.to_host(w) for w in W], tuple(_backend.to_host(h) for h in head)
    core_args = (X3, params.spec._core(), W, eps, kind, values, classes, _PARTS[part], selected)
    problem = _Problem(params, X3, dtype, kind, loss, part, names, selected, P, core_args, head, device, gpu_args)
    require_output_fits((P, columns), dtype, f"the Hessian-vector products over {', '.join(names)} (P = {P})",
                        "pass fewer samples or tokens at a time, or fewer vectors",
                        working=_products_working(problem, columns))
    return problem


def _products_working(problem: _Problem, columns: int) -> int:
    """Bytes that products with ``columns`` columns hold besides their (P, columns) result: the
    core's (the operator's caches and the products in flight) and the columns' copy in the
    problem's dtype (_vectors)."""
    B, L, _ = _sizes(problem.X3, problem.params)
    core = _working(problem.params, B, L, problem.dtype.itemsize, "products", kind=problem.kind, head=problem.head,
                    part_code=_PARTS[problem.part], selected=problem.selected, columns=columns)
    return core + problem.P * columns * problem.dtype.itemsize


def _kept(problem: _Problem) -> _Problem:
    """``problem`` with its own copies of the arrays that may be the caller's (X, the target's
    values or classes, the weights, which ``params.arrays`` hands out, the head): an operator reads
    them again later (its diagonal), and must then see them as they were."""
    X3, spec, W, eps, kind, values, classes, part, selected = problem.core_args
    X3, values, classes = (None if a is None else a.copy() for a in (X3, values, classes))
    W = [w.copy() for w in W]
    head = tuple(None if a is None else a.copy() for a in problem.head)
    # The GPU operator keeps copies of X and the weights itself, and reads the target once, when built.
    return problem._replace(X3=X3, core_args=(X3, spec, W, eps, kind, values, classes, part, selected), head=head)


@returns_callers_kind
def loss_hvp(
    X: Any,
    target: Any,
    params: BlockParams,
    V: Any,
    *,
    loss: str = "mse",
    part: str = "full",
    eps: float | None = None,
    wrt: tuple[str, ...] | None = None,
    head: Any = None,
) -> np.ndarray:
    """H @ V, exact and matrix-free: the loss Hessian (``part`` "full", "outer" or "functional")
    over the parameters in ``wrt`` times V of shape (P,) or (P, k), rows ordered like
    ``params.flatten()`` restricted to ``wrt``. V takes part in the dtype promotion and lives on
    X's side (GPU arrays: computed from host copies, the result on X's device). For many products
    at the same point, build :func:`hessian_operator` once."""
    V_array = float_array(V, "V", ndim=(1, 2))
    columns = V_array.shape[1] if V_array.ndim == 2 else 1
    problem = _problem(X, target, params, loss, part, eps, wrt, columns, promote_with=(V_array,), head=head)
    if (problem.device is None) != (not _backend.is_device_array(V_array)):
        raise TypeError("V must be on the same side as X: both NumPy (or CPU tensors) or both on the GPU")
    if problem.gpu_args is not None:
        return _on_gpu(V_array, problem.P, problem.names, problem.dtype,
                       lambda rows, out: _gpu_launch.engine_loss_hvp(*problem.gpu_args, rows, out))

    def product(V_host: np.ndarray) -> np.ndarray:
        V_host = _vectors(V_host, problem.P, problem.names, problem.dtype)
        out = np.empty(V_host.shape, dtype=problem.dtype)
        # One call, the weights read in place (no operator kept, nothing copied that need not be).
        _core.loss_hvp(*problem.core_args, V_host, out, *problem.head)
        return out

    return _backend.engine_on_host(V_array, product, V_array)
