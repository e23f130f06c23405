"""What every curvature operator of blockhess offers on top of its product H V: vector handling
(NumPy or torch in, the same kind out), scipy interop, the exact diagonal and traces, extreme
eigenvalues and the spectral density (blockhess.spectrum)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._interop import is_torch_tensor, to_torch
from ._validate import float_array


class CurvatureOperator:
    """A symmetric (P, P) operator over the parameters in ``names`` (their sizes ``_sizes``).
    Subclasses set ``shape``, ``dtype``, ``names`` and ``_sizes`` and implement ``_product(V)`` (H V
    for a checked float array V of shape (P,) or (P, k)) and ``_compute_diagonal()``."""

    shape: tuple[int, int]
    dtype: np.dtype
    names: tuple[str, ...]
    _sizes: tuple[int, ...]
    _diagonal: np.ndarray | None = None

    def _product(self, V: Any) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _compute_diagonal(self) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(self, V: Any, ndim: int) -> np.ndarray:
        return self._product(float_array(V, "V" if ndim == 2 else "v", ndim=ndim))

    def matvec(self, v: Any) -> Any:
        """H v for v of shape (P,)."""
        product = self._apply(v, 1)
        return to_torch(product) if is_torch_tensor(v) else product

    def matmat(self, V: Any) -> Any:
        """H V for V of shape (P, k); the k products run in parallel."""
        product = self._apply(V, 2)
        return to_torch(product) if is_torch_tensor(V) else product

    def __matmul__(self, V: Any) -> Any:
        return self.matmat(V) if len(getattr(V, "shape", ())) == 2 else self.matvec(V)

    def diagonal(self) -> np.ndarray:
        """The Hessian's diagonal (P,), exact: assembled from the per-token factors and curvature
        terms like the dense Hessian, with no block of it formed and no random probes."""
        if self._diagonal is None:
            self._diagonal = self._compute_diagonal()
            self._diagonal.setflags(write=False)
        return self._diagonal

    def trace(self, by_block: bool = False) -> float | dict[tuple[str, str], float]:
        """tr(H), exact (the sum of :meth:`diagonal`); by_block=True: a dict keyed like
        ``loss_hessian(layout="blocks")``'s diagonal blocks, ``{("W_Q", "W_Q"): tr(H_QQ), ...}``."""
        diag = self.diagonal()
        if not by_block:
            return float(np.sum(diag, dtype=np.float64))
        bounds = np.cumsum((0, *self._sizes))
        return {(n, n): float(np.sum(diag[a:b], dtype=np.float64))
                for n, a, b in zip(self.names, bounds[:-1], bounds[1:])}

    def frobenius_norm(self, by_block: bool = False) -> float | dict[tuple[str, str], float]:
        """||H||_F, exact and without random probes: the columns of H come from products with the
        columns of the identity, a chunk at a time (at most 64 MiB of them), and only their sums of
        squares are kept. That is P products, so it is for one parameter block (``wrt=(name,)``)
        or a small block: no factor-only form exists, since ||J^T G J||_F needs every pair of
        tokens. by_block=True: ``{(a, b): ||H[a, b]||_F}`` for every pair, keyed like
        ``loss_hessian(layout="blocks")``."""
        P = self.shape[0]
        itemsize = np.dtype(self.dtype).itemsize
        chunk = int(max(1, min(P, (64 << 20) // (2 * P * itemsize))))
        bounds = np.cumsum((0, *self._sizes))
        squares = np.zeros((len(self.names), len(self.names)))
        for b, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            for first in range(int(start), int(stop), chunk):  # chunks never straddle two blocks
                last = min(first + chunk, int(stop))
                E = np.zeros((P, last - first), dtype=self.dtype)
                E[np.arange(first, last), np.arange(last - first)] = 1
                columns = np.asarray(self._product(E), dtype=np.float64)
                for a, (top, bottom) in enumerate(zip(bounds[:-1], bounds[1:])):
                    squares[a, b] += float(np.sum(columns[top:bottom] ** 2))
        if not by_block:
            return float(np.sqrt(squares.sum()))
        return {(m, n): float(np.sqrt(squares[i, j])) for i, m in enumerate(self.names)
                for j, n in enumerate(self.names)}

    def eigsh(self, k: int = 6, which: str = "LA", tol: float = 0.0, return_eigenvectors: bool = True):
        """k extreme eigenvalues (ascending) of the operator by Lanczos (scipy's ARPACK) through the
        exact H v: which "LA" (largest), "SA" (smallest: how non-convex) or "LM" (largest
        magnitude); with the eigenvectors as columns unless return_eigenvectors=False. For one
        parameter block, build the operator with ``wrt=(name,)``."""
        from .spectrum import eigsh

        return eigsh(self, k, which, tol, return_eigenvectors)

    def spectral_density(self, *, probes: int = 10, steps: int = 60, sigma: float | None = None,
                         grid: Any = 1000, seed: int = 0):
        """The spectral density by stochastic Lanczos quadrature (blockhess.spectrum): ``probes``
        Rademacher probes of ``steps`` Lanczos steps each, broadened by a Gaussian of width
        ``sigma``; returns a :class:`blockhess.spectrum.SpectralDensity` (``.grid``, ``.density``,
        integrating to 1, and the quadrature's ``.moment(m)``)."""
        from .spectrum import spectral_density

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
