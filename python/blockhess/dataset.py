"""The Hessian of a data set's mean loss, batch by batch: the paper's H^(k) over k samples, as an
operator that never holds more than one batch's curvature per product, on this process or across
the workers of a Dask cluster.

H = sum_b (n_b / N) H_b, H_b the exact Hessian of batch b's mean loss (n_b samples, N in all), so
H is the Hessian of the mean loss over every sample. Each batch's operator (hessian_operator:
forward and reverse passes cached) is built once where the batch lives; a product H v is the
weighted sum of the batch products, each worker summing its own batches before the partial sums
are reduced on the client.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from . import _backend
from ._curvature_operator import CurvatureOperator
from ._interop import as_array, holds_torch
from ._validate import common_dtype, contiguous, float_array, owned_copy, require_output_fits
from .block import BlockParams, _selected_sizes, _selection, loss_hessian
from .hvp import hessian_operator


def _pairs(batches: Any) -> list[tuple[Any, Any]]:
    """``batches`` as a list of (X, target) pairs. A pair is a tuple or a list of two: a bare array
    would otherwise be split silently into its first two rows."""
    try:
        batches = list(batches)
    except TypeError:
        raise TypeError(f"batches must be an iterable of (X, target) pairs, got {type(batches).__name__}") from None
    if not batches:
        raise ValueError("batches must hold at least one (X, target) pair")
    for b, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)):
            raise TypeError(f"batch {b} must be an (X, target) pair (a tuple or list), got {type(batch).__name__}")
        if len(batch) != 2:
            raise ValueError(f"batch {b} must be an (X, target) pair, got {len(batch)} items")
    return [tuple(batch) for batch in batches]


def _batch_X(X: Any, b: int) -> np.ndarray:
    X = float_array(X, f"X of batch {b}")
    if X.ndim not in (2, 3):
        raise ValueError(f"each batch's X must be (L, d) or (B, L, d), got shape {tuple(X.shape)} in batch {b}")
    return X


def _own_copies(batches, params: BlockParams, loss: str, head: Any):
    """(batches, params, head): the operator's own copies of every array it reads, in the common
    dtype of them all (float32 only if every float array is float32, as for every other function).
    Every method then answers for the data as they were at construction, whatever the caller does
    to its arrays afterwards."""
    Xs = [_batch_X(X, b) for b, (X, _) in enumerate(batches)]
    float_targets = loss == "mse"  # a float target takes part in the dtype; class indices are kept as they are
    targets = [float_array(t, f"target of batch {b}") if float_targets else as_array(t, f"target of batch {b}")
               for b, (_, t) in enumerate(batches)]
    head_arrays = ()
    if isinstance(head, (tuple, list)) and len(head) == 2:  # any other head is refused when the batches are built
        head_arrays = tuple(float_array(h, name) for h, name in zip(head, ("W_C", "b_C")))
    floats = (*Xs, *(targets if float_targets else ()), *params.arrays, *head_arrays)
    if any(_backend.is_device_array(a) for a in (*floats, *targets)):
        raise TypeError("dataset_hessian_operator runs on the CPU only so far; pass NumPy arrays (cupy.asnumpy)")
    dtype = common_dtype(*floats)
    owned = [(owned_copy(X, dtype), owned_copy(t, dtype if float_targets else None)) for X, t in zip(Xs, targets)]
    params = BlockParams.from_arrays(params.spec, dict(zip(params.names, params.arrays)))  # copies them
    if head_arrays:
        head = tuple(owned_copy(h, dtype) for h in head_arrays)
    return owned, params, head


def _check_client(client: Any) -> None:
    """A TypeError or ValueError unless ``client`` is a running dask.distributed.Client (rather than
    an AttributeError deep in Dask, or a wait on a closed connection)."""
    try:
        from distributed import Client
    except ImportError:
        raise TypeError("client must be a dask.distributed.Client, and dask.distributed is not installed: "
                        "pip install 'blockhess[dask]'") from None
    if not isinstance(client, Client):
        raise TypeError(f"client must be a dask.distributed.Client, got {type(client).__name__}")
    if client.status != "running":
        raise ValueError(f"the Dask client is not running (status {client.status!r}); pass a connected client")


def _build(X, target, params, options):
    return hessian_operator(X, target, params, **options)


def _weighted_products(operators, weights, V):
    """sum_b w_b H_b V over one worker's batches (float64 accumulation)."""
    total = None
    for op, w in zip(operators, weights):
        term = w * np.asarray(op._product(V), dtype=np.float64)
        total = term if total is None else total + term
    return total


def _weighted_diagonals(operators, weights):
    return sum(w * np.asarray(op.diagonal(), dtype=np.float64) for op, w in zip(operators, weights))


class _WorkerShard:
    """One Dask worker's batches (a Dask actor living on that worker): their operators, built
    there and never moved, and their weighted partial sums."""

    def __init__(self, operators, weights) -> None:
        self.operators = operators
        self.weights = weights

    def product(self, V):
        return _weighted_products(self.operators, self.weights, V)

    def diagonal(self):
        return _weighted_diagonals(self.operators, self.weights)


class DatasetHessianOperator(CurvatureOperator):
    """The Hessian of the mean loss over every sample of ``batches`` (see the module docstring),
    with the methods of :class:`blockhess.HessianOperator`: ``@``, ``matvec``, ``matmat``,
    ``to_scipy()``, ``diagonal()``, ``trace(by_block)``, ``eigsh(...)``, ``spectral_density(...)``;
    and :meth:`running_differences`, the sequence ||H^(k+1) - H^(k)|| as batches are added."""

    def __init__(self, batches, params: BlockParams, options: dict[str, Any], client: Any = None) -> None:
        """From the checked, owned batches, params and options of :func:`dataset_hessian_operator`."""
        self._batches = batches
        self._params = params
        self._options = options
        self._client = client
        counts = np.array([1 if X.ndim == 2 else X.shape[0] for X, _ in batches], dtype=np.float64)
        self._weights = counts / counts.sum()
        self._counts = counts
        names, _, P = _selection(params, options["wrt"])
        self.names = names
        self._sizes = _selected_sizes(params, names)
        self._diagonal = None
        if client is None:
            self._local = [_build(X, t, params, options) for X, t in batches]
            first = self._local[0]
        else:
            workers = sorted(client.scheduler_info()["workers"])
            if not workers:
                raise ValueError("the Dask client has no workers")
            # Batch b lives on worker b mod n: its operator is built there, as a task of its own,
            # and kept by that worker's actor. A product is one actor call per worker (straight to
            # the worker, past the scheduler's task bookkeeping): on 2 cores a task and a reducing
            # task cost 20-40 ms per product over 32 batches of the paper's block, an actor call 1-5 ms.
            shards = []
            for i, w in enumerate(workers):
                mine = list(range(i, len(batches), len(workers)))
                if mine:
                    built = [client.submit(_build, *batches[b], params, options, workers=[w],
                                           allow_other_workers=False, pure=False) for b in mine]
                    shards.append(client.submit(_WorkerShard, built, self._weights[mine], workers=[w],
                                                allow_other_workers=False, actor=True, pure=False))
            # Each future keeps its actor alive on its worker; the actor keeps the operators.
            self._shards = [(future, future.result()) for future in shards]
            first = _build(*batches[0], params, options)  # dtype and size, cheaply, here
        self.dtype = first.dtype
        self.shape = first.shape
        self.loss = first.loss
        self.part = first.part

    def __repr__(self) -> str:
        where = "local" if self._client is None else f"{len(self._shards)} Dask workers"
        return (f"DatasetHessianOperator(shape={self.shape}, dtype={self.dtype}, batches={len(self._batches)}, "
                f"samples={int(self._counts.sum())}, loss={self.loss!r}, part={self.part!r}, {where})")

    def _reduce(self, method: str, *args):
        """The actors' method(*args) on every worker at once, their partial sums added here."""
        calls = [getattr(actor, method)(*args) for _, actor in self._shards]
        return sum(call.result() for call in calls)

    def _product(self, V: Any) -> np.ndarray:
        P = self.shape[0]
        if V.shape[0] != P:
            raise ValueError(f"V must have {P} rows (the parameters in wrt={self.names}), got shape {tuple(V.shape)}")
        V = contiguous(np.asarray(V), self.dtype)
        if self._client is None:
            total = _weighted_products(self._local, self._weights, V)
        else:
            total = self._reduce("product", V)
        return total.astype(self.dtype, copy=False)

    def _product_working(self, columns: int) -> int:
        """The largest batch product's working memory, plus the float64 running sum and term."""
        local = max(op._product_working(columns) for op in self._local) if self._client is None else 0
        return local + 16 * self.shape[0] * columns

    def _compute_diagonal(self) -> np.ndarray:
        if self._client is None:
            total = _weighted_diagonals(self._local, self._weights)
        else:
            total = self._reduce("diagonal")
        return np.asarray(total).astype(self.dtype, copy=False)

    def running_differences(self, norm: str = "spectral", *, tol: float = 1e-8) -> np.ndarray:
        """||H^(k+1) - H^(k)|| for k = 1 .. len(batches) - 1, H^(k) the Hessian of the mean loss over
        the first k batches (the quantity of the paper's Thm 7). norm="spectral": by Lanczos on the
        difference operator (n_{k+1} / N_{k+1}) (H_{k+1} - H^(k)) through the exact products;
        "frobenius": exact, from the dense batch Hessians (small P only; refused when they would not
        fit the memory budget)."""
        from ._validate import choice
        from .spectrum import eigsh

        choice(norm, "norm", ("spectral", "frobenius"))
        K = len(self._batches)
        out = []
        if norm == "frobenius":
            P = self.shape[0]
            require_output_fits((2, P, P), self.dtype, f"two dense ({P}, {P}) Hessians",
                                "use norm='spectral', which needs no dense matrix")
            running = None
            for k, (X, t) in enumerate(self._batches):
                H = np.asarray(loss_hessian(X, t, self._params, **self._options), dtype=np.float64)
                if running is not None:
                    share = self._counts[k] / self._counts[: k + 1].sum()
                    out.append(share * float(np.linalg.norm(H - running)))
                    running = running + share * (H - running)
                else:
                    running = H
            return np.asarray(out)
        if self._client is not None:
            raise ValueError("running_differences(norm='spectral') runs on the local operator (client=None)")
        from scipy.sparse.linalg import LinearOperator

        for k in range(1, K):
            prefix = self._counts[:k] / self._counts[:k].sum()
            share = self._counts[k] / self._counts[: k + 1].sum()
            ops = self._local[: k + 1]

            def difference(v, ops=ops, prefix=prefix, share=share):
                v = np.ascontiguousarray(v, dtype=self.dtype)
                previous = _weighted_products(ops[:-1], prefix, v)
                return share * (np.asarray(ops[-1]._product(v), dtype=np.float64) - previous)

            class _Difference:
                shape = self.shape

                @staticmethod
                def to_scipy():
                    return LinearOperator(self.shape, matvec=difference, rmatvec=difference, dtype=np.float64)

            value = eigsh(_Difference(), 1, "LM", tol, False)
            out.append(float(np.abs(value).max()))
        return np.asarray(out)


def dataset_hessian_operator(batches: Iterable[tuple[Any, Any]], params: BlockParams, *, loss: str = "mse",
                             part: str = "full", eps: float | None = None, wrt: tuple[str, ...] | None = None,
                             head: Any = None, client: Any = None) -> DatasetHessianOperator:
    """The exact Hessian of the mean loss over an iterable of (X, target) batches (each X (L, d) or
    (B, L, d); batches may differ in B), as an operator. Arguments as in
    :func:`blockhess.hessian_operator`; ``client``: a ``dask.distributed.Client`` whose workers
    each build and keep their share of the batches' operators (they need blockhess installed)."""
    if not isinstance(params, BlockParams):
        raise TypeError(f"params must be a blockhess.BlockParams, got {type(params).__name__}")
    if client is not None:
        _check_client(client)
    pairs = _pairs(batches)
    from_torch = holds_torch(params, head, *(array for pair in pairs for array in pair))  # the caller's own
    batches, params, head = _own_copies(pairs, params, loss, head)
    options = dict(loss=loss, part=part, eps=eps, wrt=wrt, head=head)
    operator = DatasetHessianOperator(batches, params, options, client)
    operator._from_torch = from_torch
    return operator
