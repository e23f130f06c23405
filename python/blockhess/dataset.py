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

from ._curvature_operator import CurvatureOperator
from ._interop import as_array
from ._validate import contiguous, require_output_fits
from .block import BlockParams, _selected_sizes, _selection, loss_hessian
from .hvp import hessian_operator


def _samples(X: Any) -> int:
    shape = tuple(as_array(X, "X").shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"each batch's X must be (L, d) or (B, L, d), got shape {shape}")
    return 1 if len(shape) == 2 else shape[0]


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
        self._batches = batches
        self._params = params
        self._options = options
        self._client = client
        counts = np.array([_samples(X) for X, _ in batches], dtype=np.float64)
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
    try:
        batches = [tuple(b) for b in batches]
    except TypeError:
        raise TypeError("batches must be an iterable of (X, target) pairs") from None
    if not batches:
        raise ValueError("batches must hold at least one (X, target) pair")
    if any(len(b) != 2 for b in batches):
        raise ValueError("every batch must be an (X, target) pair")
    options = dict(loss=loss, part=part, eps=eps, wrt=wrt, head=head)
    return DatasetHessianOperator(batches, params, options, client)
