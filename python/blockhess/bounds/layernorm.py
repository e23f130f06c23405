"""Lemma 4: the LayerNorm Jacobian and Hessian norms (docs/errata.md E14).

LN acts on the rows of X (m, n): y_i = (x_i - mean_i) / sigma_i, sigma_i = sqrt(var_i + eps).

As stated (sigma_min printed as min_i ||m_i||_2, the norm of a centred row):

    ||J_LN|| <= 1/sigma_min + ||X||^2 / (sqrt(n) sigma_min^3)
    ||H_LN|| <= ||X||/sigma_min^3 (1 + sqrt(m/n)) + ||X||^2/(sqrt(n) sigma_min^3) + 3 ||X||^3/(n sigma_min^5)

The row norm is sqrt(n) times the row std, so with it both bounds fail (the proof uses the std).

Corrected (exact at eps = 0, n >= 3), with sigma_min = min_i sigma_i the row std:

* J_i = (P_c - y_i y_i^T / n) / sigma_i, P_c = I - 11^T/n. y_i is orthogonal to 1 with |y_i|^2 = s_i =
  n var_i/(var_i + eps) <= n, so P_c - y y^T/n has eigenvalues 0 (on 1), 1 - s_i/n (on y_i) and 1:
  ||J_LN|| = max_i 1/sigma_i <= 1/sigma_min, with equality for n >= 3.
* Row i's second derivative, applied to a unit v, is the n x n matrix
  N(v) = -(t P_c + w y^T + y w^T - (3/n) t y y^T) / (n sigma_i^2), t = y.v, w = P_c v (so y.w = t), and
  ||N(v)||_F^2 n^2 sigma_i^4 = t^2 k + 2 s |w|^2 with k = n + 5 + 9 x^2 - 18 x, x = s/n. Since t^2 <= s|w|^2
  and |w| <= 1, the spectral norm of row i's (n^2, n) unfolding (the dense (mn)^2 x mn matrix is
  block-diagonal over rows after a permutation) is sqrt(s max(k + 2, 2)) / (n sigma_i^2) (equality
  for n >= 3). As x ranges over [0, 1], x max(k + 2, 2) <= G(n) = max(2, sup p), p(x) = x (n + 7 + 9x^2 - 18x),
  whose sup is taken at x = 1 or at a root of p'; so

      ||H_LN|| <= sqrt(G(n) / n) / sigma_min^2          (G(n) = max(n - 2, 2) at eps = 0, n >= 5).

  It scales as c^-2 when X does, as the true Hessian; the stated middle term (c^-1) does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._validate import float_array, nonneg_scalar
from ..layernorm import layernorm_hessian, layernorm_jacobian
from ._bound import Bound
from ._float import overflow_is_inf, power_of_two_scale


def row_std(X: np.ndarray, eps: float = 0.0) -> np.ndarray:
    """sigma_i = sqrt(var_i + eps) of each row (population variance), at any finite scale of X: the
    rows are scaled by a power of two first, so that their squares cannot overflow."""
    scale = power_of_two_scale(X, axis=-1)
    return np.hypot(scale[..., 0] * (X / scale).std(axis=-1), np.sqrt(eps))


def hessian_constant(n: int) -> float:
    """G(n) = sup over x in [0, 1] of x max(n + 7 + 9x^2 - 18x, 2) (see the module docstring)."""
    candidates = [1.0]
    discriminant = 36.0**2 - 4 * 27.0 * (n + 7)  # p'(x) = 27x^2 - 36x + n + 7
    if discriminant >= 0:
        candidates += [(36.0 + sign * np.sqrt(discriminant)) / 54.0 for sign in (-1, 1)]
    p = [x * (n + 7 + 9 * x * x - 18 * x) for x in candidates if 0.0 <= x <= 1.0]
    return max(2.0, *p)


# The four bounds below are numpy float64 (inf past the float range, see _float.py), written in
# r = ||X|| / sigma_min and 1 / sigma_min so that no intermediate leaves the range the bound is in.


def jacobian_bound(sigma_min: float) -> np.float64:
    """The corrected Lemma 4 bound on ||J_LN||: 1 / sigma_min (exact for n >= 3)."""
    return 1 / np.float64(sigma_min)


def hessian_bound(sigma_min: float, n: int) -> np.float64:
    """The corrected Lemma 4 bound on ||H_LN||: sqrt(G(n)/n) / sigma_min^2."""
    return np.sqrt(hessian_constant(n) / n) * jacobian_bound(sigma_min) ** 2


def stated_jacobian_bound(X_norm: float, sigma_min: float, n: int) -> np.float64:
    """1/sigma_min + ||X||^2 / (sqrt(n) sigma_min^3)."""
    inverse = jacobian_bound(sigma_min)
    r = X_norm * inverse
    return inverse + r**2 * inverse / np.sqrt(n)


def stated_hessian_bound(X_norm: float, sigma_min: float, m: int, n: int) -> np.float64:
    """||X||/sigma_min^3 (1 + sqrt(m/n)) + ||X||^2/(sqrt(n) sigma_min^3) + 3 ||X||^3/(n sigma_min^5)."""
    inverse = jacobian_bound(sigma_min)
    r = X_norm * inverse
    return r * (1 + np.sqrt(m / n)) * inverse**2 + r**2 * inverse / np.sqrt(n) + 3 * r**3 * inverse**2 / n


def exact_norms(X: np.ndarray, eps: float = 0.0) -> tuple[float, float]:
    """||J_LN||_2 and ||H_LN||_2 (the dense (mn)^2 x mn layout), from blockhess's per-row blocks:
    both dense matrices are block-diagonal over rows after a permutation."""
    m, n = X.shape
    J = layernorm_jacobian(X, eps=eps, layout="blocks")
    H = layernorm_hessian(X, eps=eps, layout="blocks").reshape(m, n * n, n)
    return float(np.linalg.norm(J, 2, axis=(1, 2)).max()), float(np.linalg.norm(H, 2, axis=(1, 2)).max())


@overflow_is_inf
def lemma4(X: Any, *, eps: float = 0.0) -> list[Bound]:
    """Lemma 4 on the LayerNorm input ``X`` (m, n), float64: the Jacobian and Hessian norms, exact,
    as stated (with the printed row-norm sigma_min; ``extra["stated_row_std"]`` with the std) and
    corrected (module docstring). A bound past the float64 range is inf; an exact norm past it, a
    NonFiniteError."""
    X = np.asarray(float_array(X, "X", ndim=2), dtype=np.float64)
    eps = nonneg_scalar(eps, "eps")
    m, n = X.shape
    sigma = row_std(X, eps)
    if sigma.min() <= 0:
        raise ValueError("Lemma 4 needs every row of X to have positive variance (or eps > 0): Assumption 2")
    row_norm = np.sqrt(n) * row_std(X).min()  # the printed sigma_min: a centred row's norm is sqrt(n) std
    X_norm = np.linalg.norm(X, 2)
    exact_J, exact_H = exact_norms(X, eps)
    s_min = sigma.min()
    return [
        Bound("Lemma 4: ||J_LN||", exact_J, stated_jacobian_bound(X_norm, row_norm, n), jacobian_bound(s_min),
              erratum="E14", source="Lemma 4",
              extra={"stated_row_std": stated_jacobian_bound(X_norm, s_min, n)}),
        Bound("Lemma 4: ||H_LN||", exact_H, stated_hessian_bound(X_norm, row_norm, m, n), hessian_bound(s_min, n),
              erratum="E14", source="Lemma 4",
              extra={"stated_row_std": stated_hessian_bound(X_norm, s_min, m, n)}),
    ]
