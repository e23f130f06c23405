"""What every curvature operator of blockhess offers on top of its product H V: vector handling
(NumPy or torch in, the same kind out), scipy interop, the exact diagonal and traces, extreme
eigenvalues and the spectral density (blockhess.spectrum), each within the memory budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend
from ._config import get_memory_budget
from ._interop import is_torch_tensor, to_torch
from ._validate import boolean, choice, float_array, integer, positive_int, require_output_fits
from .estimate import hutch_plus_plus, hutchinson


class CurvatureOperator:
    """A symmetric (P, P) operator over the parameters in ``names`` (their sizes ``_sizes``).
    Subclasses set ``shape``, ``dtype``, ``names`` and ``_sizes`` and implement ``_product(V)`` (H V
    for a checked float array V of shape (P,) or (P, k)) and ``_compute_diagonal()``; they may
    override ``_product_working(columns)`` (the bytes a product holds besides its result, for the
    memory budget) and set ``_from_torch`` (results without a vector argument, the diagonal and
    eigsh's, are then torch tensors)."""

    shape: tuple[int, int]
    dtype: np.dtype
    names: tuple[str, ...]
    _sizes: tuple[int, ...]
    _diagonal: np.ndarray | None = None
    _from_torch: bool = False
    _device: Any = None  # built from GPU arrays: one of them (results without a vector go to its device)

    def _product(self, V: Any) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _device_product(self, V: Any) -> Any:
        """H V for a GPU V where the engine runs it on the GPU; None: from a host copy (_product)."""
        return None

    def _compute_diagonal(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _product_working(self, columns: int) -> int:
        """Bytes a product with ``columns`` columns holds besides its (P, columns) result."""
        return 0

    def _callers_kind(self, result: Any) -> Any:
        """A result without a vector argument (the diagonal, eigsh's) on the side of the operator's
        inputs: on their device for GPU inputs, torch tensors for tensors."""
        if self._device is not None:
            on_device = lambda a: _backend.to_device_of(self._device, a) if isinstance(a, np.ndarray) else a  # noqa: E731
            result = tuple(map(on_device, result)) if isinstance(result, tuple) else on_device(result)
        return to_torch(result) if self._from_torch else result

    def _apply(self, V: Any, ndim: int) -> Any:
        """H V for a vector or matrix V, on V's side: a GPU V gets the product on its device (on the
        GPU where the engine runs it there, else from a host copy)."""
        V = float_array(V, "V" if ndim == 2 else "v", ndim=ndim)
        columns = V.shape[1] if V.ndim == 2 else 1
        P = self.shape[0]
        require_output_fits((P, columns), self.dtype, f"the product H V over {', '.join(self.names)} (P = {P})",
                            "multiply fewer vectors at a time", working=self._product_working(columns))
        if _backend.is_device_array(V):
            product = self._device_product(V)
            if product is not None:
                return product
        return _backend.engine_on_host(V, self._product, V)

    def matvec(self, v: Any) -> Any:
        """H v for v of shape (P,)."""
        product = self._apply(v, 1)
        return to_torch(product) if is_torch_tensor(v) else product

    def matmat(self, V: Any) -> Any:
        """H V for V of shape (P, k); the k products run in parallel."""
        product = self._apply(V, 2)
        return to_torch(product) if is_torch_tensor(V) else product

    def __matmul__(self, V: Any) -> Any:
        ndim = len(V.shape) if hasattr(V, "shape") else np.ndim(V)  # np.ndim reads nested lists
        return self.matmat(V) if ndim == 2 else self.matvec(V)

    def diagonal(self, exact: bool = True, *, probes: int = 100, seed: int = 0) -> Any:
        """The Hessian's diagonal (P,) (a torch tensor when the operator was built from tensors).

        exact=True: assembled from the per-token factors and curvature terms like the dense Hessian,
        with no block of it formed and no random probes; the entries of the parameters the factors do
        not reach (a model's lower layers, its embeddings) from one exact product each
        (docs/derivation.md §5.4), refused above ``blockhess.hvp.EXACT_PRODUCTS_LIMIT`` (65,536) of
        them.
        exact=False: Hutchinson's estimate from ``probes`` Rademacher probes (``probes`` products),
        returned as an :class:`blockhess.estimate.Estimate` (value, standard_error, probes)."""
        if not boolean(exact, "exact"):
            estimate = self._hutchinson(probes, seed)[0]
            return estimate._replace(value=self._callers_kind(estimate.value),
                                     standard_error=self._callers_kind(estimate.standard_error))
        return self._callers_kind(self._diagonal_array())

    def _diagonal_array(self) -> np.ndarray:
        """The diagonal as a read-only NumPy array, computed once."""
        if self._diagonal is None:
            self._diagonal = self._compute_diagonal()
            self._diagonal.setflags(write=False)
        return self._diagonal

    def trace(self, by_block: bool = False, exact: bool = True, *, probes: int = 100, seed: int = 0,
              method: str = "hutchinson"):
        """tr(H) (the sum of :meth:`diagonal`); by_block=True: a dict keyed like
        ``loss_hessian(layout="blocks")``'s diagonal blocks, ``{("W_Q", "W_Q"): tr(H_QQ), ...}``.
        exact=False: estimates (an :class:`blockhess.estimate.Estimate`, or a dict of them) from
        ``probes`` products, for where the exact diagonal costs too much: method="hutchinson"
        (Rademacher probes, every block's from the same ones) or, for the whole trace, "hutch++"
        (estimate.py: a sketch of the top of the spectrum taken exactly, Hutchinson's on the rest;
        at least 4 probes, and it holds (P, probes / 3) arrays at once)."""
        method = choice(method, "method", ("hutchinson", "hutch++"))
        if not boolean(exact, "exact"):
            if method == "hutch++":
                return self._hutch_plus_plus(by_block, probes, seed)
            _, traces, total = self._hutchinson(probes, seed)
            return {(n, n): t for n, t in zip(self.names, traces)} if by_block else total
        diag = self._diagonal_array()
        if not by_block:
            return float(np.sum(diag, dtype=np.float64))
        bounds = np.cumsum((0, *self._sizes))
        return {(n, n): float(np.sum(diag[a:b], dtype=np.float64))
                for n, a, b in zip(self.names, bounds[:-1], bounds[1:])}

    def _hutchinson(self, probes: int, seed: int):
        """(diagonal, per-block traces, whole trace) Estimates from ``probes`` Rademacher probes
        (estimate.py)."""
        probes = positive_int(probes, "probes")
        if probes < 2:
            raise ValueError("probes must be at least 2 (the standard error needs two), got 1")
        chunk = min(probes, self._column_chunk("the probes H Z that the estimate takes, a chunk at a time,",
                                               "build the operator over fewer parameters, e.g. wrt=(name,)"))
        return hutchinson(self._product, self._sizes, self.dtype, probes, integer(seed, "seed", least=0), chunk)

    def _hutch_plus_plus(self, by_block: bool, probes: int, seed: int):
        """Hutch++'s estimate of the whole trace (estimate.py)."""
        if by_block:
            raise ValueError("method='hutch++' estimates the whole trace (its sketch spans every block); "
                             "for the blocks' traces use method='hutchinson' or exact=True")
        probes = positive_int(probes, "probes")
        if probes < 4:
            raise ValueError(f"probes must be at least 4 for method='hutch++' (a sketch, its basis and two "
                             f"residual probes), got {probes}")
        P = self.shape[0]
        require_output_fits((P, 2 * (probes // 3)), self.dtype, "Hutch++'s sketch and its products",
                            "use fewer probes, or method='hutchinson', which takes its probes a chunk at a time",
                            working=self._product_working(probes // 3))
        return hutch_plus_plus(self._product, P, self.dtype, probes, integer(seed, "seed", least=0))

    def frobenius_norm(self, by_block: bool = False) -> float | dict[tuple[str, str], float]:
        """||H||_F, exact and without random probes: the columns of H come from products with the
        columns of the identity, a chunk at a time (at most 64 MiB of them, less under a smaller
        memory budget), and only their sums of squares are kept. That is P products, so it is for
        one parameter block (``wrt=(name,)``) or a small block: no factor-only form exists, since
        ||J^T G J||_F needs every pair of tokens. by_block=True: ``{(a, b): ||H[a, b]||_F}`` for
        every pair, keyed like ``loss_hessian(layout="blocks")``."""
        P = self.shape[0]
        chunk = self._column_chunk("the columns of H that frobenius_norm sums, a chunk at a time,",
                                   "build the operator over fewer parameters, e.g. wrt=(name,)")
        bounds = np.cumsum((0, *self._sizes))
        squares = np.zeros((len(self.names), len(self.names)))
        for b, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            for first in range(int(start), int(stop), chunk):  # chunks never straddle two blocks
                last = min(first + chunk, int(stop))
                E = np.zeros((P, last - first), dtype=self.dtype)
                E[np.arange(first, last), np.arange(last - first)] = 1
                columns = self._product(E)
                for a, (top, bottom) in enumerate(zip(bounds[:-1], bounds[1:])):
                    squares[a, b] += float(np.sum(np.square(columns[top:bottom], dtype=np.float64)))
        if not by_block:
            return float(np.sqrt(squares.sum()))
        return {(m, n): float(np.sqrt(squares[i, j])) for i, m in enumerate(self.names)
                for j, n in enumerate(self.names)}

    def _column_chunk(self, what: str, hint: str) -> int:
        """How many columns of products a method forms at a time: at most 64 MiB of them, halved
        until the chunk fits the memory budget; OutputTooLargeError (naming ``what`` and ``hint``)
        when not even one column does."""
        P, itemsize = self.shape[0], np.dtype(self.dtype).itemsize

        def working(columns: int) -> int:  # besides the (P, columns) product: the columns and float64 sums
            return P * columns * (itemsize + 8) + self._product_working(columns)

        chunk = int(max(1, min(P, (64 << 20) // (P * (2 * itemsize + 8)))))
        budget = get_memory_budget()
        while chunk > 1 and P * chunk * itemsize + working(chunk) > budget:
            chunk //= 2
        require_output_fits((P, chunk), self.dtype, what, hint, working=working(chunk))
        return chunk

    def eigsh(self, k: int = 6, which: str = "LA", tol: float = 0.0, return_eigenvectors: bool = True):
        """k extreme eigenvalues (ascending) of the operator by Lanczos (scipy's ARPACK) through the
        exact H v: which "LA" (largest), "SA" (smallest: how non-convex) or "LM" (largest
        magnitude); with the eigenvectors as columns unless return_eigenvectors=False. For one
        parameter block, build the operator with ``wrt=(name,)``."""
        from .spectrum import eigsh  # checks its arguments and its memory (ARPACK's, or the dense matrix)

        return self._callers_kind(eigsh(self, k, which, tol, return_eigenvectors))

    def spectral_density(self, *, probes: int = 10, steps: int = 60, sigma: float | None = None,
                         grid: Any = 1000, seed: int = 0):
        """The spectral density by stochastic Lanczos quadrature (blockhess.spectrum): ``probes``
        Rademacher probes of ``steps`` Lanczos steps each, broadened by a Gaussian of width
        ``sigma``; returns a :class:`blockhess.spectrum.SpectralDensity` (``.grid``, ``.density``,
        integrating to 1, and the quadrature's ``.moment(m)``)."""
        from .spectrum import spectral_density  # checks its memory (the Lanczos bases, the grid)

        return spectral_density(self._matvec64, self.shape[0], probes=probes, steps=steps, sigma=sigma, grid=grid,
                                seed=seed)

    def _matvec64(self, v: np.ndarray) -> np.ndarray:
        return self._product(np.ascontiguousarray(v, dtype=self.dtype))

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` over this operator (scipy is optional)."""
        try:
            from scipy.sparse.linalg import LinearOperator
        except ImportError as err:  # pragma: no cover - scipy is in the test extra
            raise ImportError("to_scipy() needs scipy: pip install scipy") from err
        return LinearOperator(self.shape, matvec=self.matvec, matmat=self.matmat, rmatvec=self.matvec,
                              dtype=self.dtype)

    def to_cupyx(self) -> Any:
        """A ``cupyx.scipy.sparse.linalg.LinearOperator`` over this operator, for CuPy's ``eigsh``,
        ``cg`` or ``lanczos`` on GPU vectors: each product is the engine's (from a host copy of the
        vector), returned on the vector's device (CuPy is optional: the ``cuda`` extra)."""
        try:
            from cupyx.scipy.sparse.linalg import LinearOperator
        except ImportError as err:
            raise ImportError("to_cupyx() needs CuPy: pip install 'blockhess[cuda]'") from err
        return LinearOperator(self.shape, matvec=self.matvec, matmat=self.matmat, rmatvec=self.matvec,
                              dtype=self.dtype)
