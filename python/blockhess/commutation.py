"""Row-major vectorisation, commutation matrices and Kronecker products (docs/derivation.md §1).

``vec_r(A) = A.reshape(-1)``; ``K_{m,n}`` is the permutation with ``K_{m,n} vec(A) = vec(A^T)`` for
``A`` of shape ``(m, n)``, i.e. ``(K_{m,n})[i*n + j, j*m + i] = 1``; hence
``vec_r(A.T) = K_{n,m} vec_r(A)``. ``(A ⊗ B) vec_r(X) = vec_r(A X B^T)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend, _core
from ._interop import returns_callers_kind
from ._validate import common_dtype, contiguous, float_array, positive_int, require_finite, require_output_fits




def _float_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"dtype must be float32 or float64, got {dt}")
    return dt


@returns_callers_kind
def vec_r(A: Any) -> np.ndarray:
    """Row-major vectorisation of a 2-D array: ``vec_r(A)[i*n + j] = A[i, j]`` (a new 1-D array)."""
    A = float_array(A, "A", ndim=2)
    xp = _backend.array_module(A)  # RuntimeError, saying how to rebuild, for a GPU array without a GPU
    with _backend.device_of(A):
        return xp.array(A, dtype=A.dtype, order="C").reshape(-1)


@returns_callers_kind
def unvec_r(v: Any, m: int, n: int) -> np.ndarray:
    """Inverse of :func:`vec_r`: the ``(m, n)`` array whose rows are stacked in ``v`` (a new array)."""
    m, n = positive_int(m, "m"), positive_int(n, "n")
    v = float_array(v, "v", ndim=1)
    if v.shape != (m * n,):
        raise ValueError(f"v must have shape ({m * n},) to unstack into ({m}, {n}), got {v.shape}")
    xp = _backend.array_module(v)  # RuntimeError, saying how to rebuild, for a GPU array without a GPU
    with _backend.device_of(v):
        return xp.array(v, dtype=v.dtype, order="C").reshape(m, n)


@returns_callers_kind
def commutation_permutation(m: int, n: int) -> np.ndarray:
    """The index map of ``K_{m,n}``: int64 ``perm`` with ``(K_{m,n} v)[r] = v[perm[r]]``."""
    m, n = positive_int(m, "m"), positive_int(n, "n")
    require_output_fits((m * n,), np.dtype(np.int64), "the commutation permutation",
                        "use blockhess.commute(v, m, n), which permutes without it")
    out = np.empty(m * n, dtype=np.int64)
    _core.commutation_permutation(m, n, out)
    return out


@returns_callers_kind
def commutation_matrix(m: int, n: int, *, dtype: Any = np.float64, like: Any = None) -> np.ndarray:
    """The dense commutation matrix ``K_{m,n}``, shape ``(m*n, m*n)``.

    ``K_{m,n} @ A.reshape(-1, order="F") == A.T.reshape(-1, order="F")`` for ``A`` of shape (m, n).
    Prefer :func:`commute`, which applies it without forming it. With ``like`` a GPU (CuPy) array,
    the matrix is built on that array's device and returned as a CuPy array.
    """
    m, n = positive_int(m, "m"), positive_int(n, "n")
    dtype = _float_dtype(dtype)
    shape = (m * n, m * n)
    require_output_fits(shape, dtype, "the dense commutation matrix", "use blockhess.commute(v, m, n)")
    if like is not None:
        like = float_array(like, "like")
    out = _backend.empty(shape, dtype, like=like)
    _backend.kernels_for(like).commutation_dense(m, n, out)
    return out


@returns_callers_kind
def commute(v: Any, m: int, n: int) -> np.ndarray:
    """``K_{m,n} v`` without forming ``K_{m,n}``.

    ``v`` is a vector of length ``m*n`` or a matrix with ``m*n`` rows (then every column is
    permuted). ``commute(vec_r(A), n, m) == vec_r(A.T)`` for ``A`` of shape (m, n).
    """
    m, n = positive_int(m, "m"), positive_int(n, "n")
    v = float_array(v, "v", ndim=(1, 2))
    if v.shape[0] != m * n:
        raise ValueError(f"v must have m*n = {m * n} rows for m={m}, n={n}, got shape {v.shape}")
    kernels = _backend.kernels_for(v)
    require_output_fits(v.shape, v.dtype, "K_{m,n} v", "pass fewer columns of v at a time")
    v = contiguous(v, v.dtype)
    out = _backend.empty(v.shape, v.dtype, like=v)
    kernels.commute(v, m, n, out)
    return out


@returns_callers_kind
def kron_apply(A: Any, B: Any, X: Any) -> np.ndarray:
    """``(A ⊗ B) vec_r(X) = vec_r(A X B^T)`` without forming ``A ⊗ B``.

    ``A`` is (p, m), ``B`` is (q, n) and ``X`` is (m, n) or its vec_r of length m*n; returns a
    vector of length p*q.
    """
    A = float_array(A, "A", ndim=2)
    B = float_array(B, "B", ndim=2)
    X = float_array(X, "X", ndim=(1, 2))
    (p, m), (q, n) = A.shape, B.shape
    if 0 in (p, m, q, n):
        raise ValueError(f"A and B must be non-empty, got shapes {A.shape} and {B.shape}")
    if X.shape not in ((m, n), (m * n,)):
        raise ValueError(
            f"X must have shape ({m}, {n}) or ({m * n},) to match A of shape {A.shape} and B of "
            f"shape {B.shape}, got {X.shape}"
        )
    kernels = _backend.kernels_for(A, B, X)
    dtype = common_dtype(A, B, X)
    A, B = contiguous(A, dtype), contiguous(B, dtype)
    X = contiguous(X, dtype).reshape(m, n)
    # The core works on aligned copies of A, B, X and the result, and forms A X or X B^T between.
    working = (p * m + q * n + m * n + p * q + max(p * n, m * q)) * dtype.itemsize
    require_output_fits((p * q,), dtype, "(A ⊗ B) vec_r(X)", "apply it to smaller operands", working=working)
    out = _backend.empty(p * q, dtype, like=A)
    kernels.kron_apply(A, B, X, out)
    return require_finite(out, "(A ⊗ B) vec_r(X)")
