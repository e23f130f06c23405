"""Input normalisation and validation shared by every public function.

Every public function normalises its inputs here (dtype policy, C-contiguous layout, finiteness,
shapes) so that the bindings only ever see arrays they accept, and users get a ValueError or
TypeError that names the offending argument.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import numpy as np

from . import _core
from ._config import format_bytes, get_memory_budget
from ._errors import NonFiniteError, OutputTooLargeError
from ._backend import array_module
from ._interop import as_array

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


_xp = array_module


def float_array(x: Any, name: str, *, ndim: int | tuple[int, ...] | None = None) -> Any:
    """Return ``x`` as an array of float32 or float64, or raise TypeError / ValueError.

    Integer, boolean, complex, object and other float widths are rejected (never cast silently).
    The dtype is kept; layout is not normalised here (see :func:`contiguous`).
    """
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    x = as_array(x, name)
    from ._backend import cuda_available, is_device_array

    if is_device_array(x) and not cuda_available():
        # A GPU array that this process cannot run: only its metadata is checked here, and the
        # caller's _backend.on_device() then raises TypeError (mixed with host arrays) or a
        # RuntimeError that says how to rebuild.
        xp = None
    else:
        xp = _xp(x)
        if xp is not np and not isinstance(x, xp.ndarray):
            x = xp.asarray(x)  # torch CUDA tensors, Numba arrays...: zero-copy via __cuda_array_interface__
    if xp is None:
        try:
            dtype = np.dtype(x.dtype)
        except (AttributeError, TypeError):  # e.g. a torch CUDA tensor: nothing more to check here
            from ._backend import require_gpu

            require_gpu()
            raise
    else:
        if not hasattr(x, "dtype"):
            try:
                x = xp.asarray(x)
            except (ValueError, TypeError) as err:
                raise TypeError(f"{name} must be a numeric array: {err}") from None
        dtype = np.dtype(x.dtype)
    if dtype.kind == "f" and not dtype.isnative:  # e.g. big-endian '>f8': the same values, converted
        dtype = dtype.newbyteorder("=")
        x = x.astype(dtype)
    if dtype not in FLOAT_DTYPES:
        if dtype.kind == "f" and dtype.itemsize < 4:
            hint = f"; cast it with {name}.astype(np.float32) if that is what you want"
        else:
            hint = ""
        raise TypeError(f"{name} must have dtype float32 or float64, got {dtype}{hint}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else ndim
        if len(x.shape) not in allowed:
            want = " or ".join(f"{k}-D" for k in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    if xp is not None and x.size and not bool(xp.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    return x


def integer(value: Any, name: str, *, least: int | None = None, most: int | None = None) -> int:
    """``value`` as an int in [least, most], or TypeError / ValueError naming ``name``. Any integer
    type (numpy's too) is accepted; bools and floats are not."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if least is not None and most is not None and not least <= value <= most:
        raise ValueError(f"{name} must be between {least} and {most}, got {value}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return value


def boolean(value: Any, name: str) -> bool:
    """``value`` when it is a bool (NumPy's too); TypeError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def positive_int(value: Any, name: str, *, most: int | None = None) -> int:
    """``value`` as an int >= 1 (and <= ``most``): :func:`integer` with ``least=1``."""
    return integer(value, name, least=1, most=most)


def common_dtype(*arrays: Any) -> np.dtype:
    """float32 if every float array is float32, else float64 (mixed inputs are promoted to float64).
    Every float array argument of a call takes part, targets included."""
    present = [np.dtype(a.dtype) for a in arrays if a is not None]
    if present and all(dt == np.float32 for dt in present):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def contiguous(x: Any, dtype: np.dtype) -> Any:
    """C-contiguous copy of ``x`` in ``dtype`` when needed; ``x`` itself when already so."""
    if x is None:
        return None
    return _xp(x).ascontiguousarray(x, dtype=dtype)


def owned_copy(x: Any, dtype: np.dtype) -> Any:
    """A C-contiguous copy of ``x`` in ``dtype`` that shares no memory with it: for state an object
    keeps, which the caller's later changes to ``x`` must not reach."""
    return _xp(x).array(x, dtype=dtype, order="C", copy=True)


def output_array(out: Any, shape: tuple[int, ...], dtype: np.dtype, inputs: tuple[Any, ...]) -> Any:
    """``out`` checked as the destination of a result: exactly ``shape`` and ``dtype``, C-contiguous,
    writeable and sharing no memory with ``inputs`` (results are written in place, never cast).

    ``inputs`` must be the caller's own arrays, not internal copies: an F-ordered X that is a view
    of ``out``'s memory is copied before the computation, and only the caller's X shows the overlap.
    """
    if isinstance(out, (list, tuple)):  # as_array would read it into a new array, not write it
        raise TypeError(f"out must be an array, got {type(out).__name__}")
    out = as_array(out, "out")
    if not (hasattr(out, "shape") and hasattr(out, "dtype") and hasattr(out, "flags")):
        raise TypeError(f"out must be an array, got {type(out).__name__}")
    if np.dtype(out.dtype) != dtype:
        raise TypeError(f"out must have dtype {dtype}, the dtype of the result, got {np.dtype(out.dtype)}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if not getattr(out.flags, "writeable", True):  # CuPy arrays are always writeable
        raise ValueError("out is read-only")
    xp = _xp(out)
    for name, a in inputs:
        a = None if a is None else as_array(a, name)
        if a is not None and hasattr(a, "dtype") and xp.may_share_memory(out, a):
            raise ValueError(f"out shares memory with {name}; pass a separate array")
    return out


def real_number(value: Any, name: str) -> float:
    """``value`` as a float: any real number type (Python's, NumPy's, fractions), not a bool; a
    TypeError naming ``name`` otherwise. Range checks are the caller's, but for an integer beyond
    the float range (a ValueError here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"{name} must be finite, got an integer beyond the float range") from None


def nonneg_scalar(value: Any, name: str) -> float:
    """``value`` as a finite float >= 0 (:func:`real_number`), or TypeError / ValueError."""
    value = real_number(value, name)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def choice(value: Any, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def require_output_fits(
    shape: tuple[int, ...], dtype: np.dtype, what: str, alternative: str, *, working: int = 0,
    into_out: bool = False,
) -> int:
    """Refuse a call whose result (``shape``, unless it goes into the caller's ``out=``) and working
    arrays (``working`` bytes) together exceed the memory budget, with an error that says what was
    asked, what fits and the way out; returns the bytes checked."""
    output = 0 if into_out else math.prod(shape) * np.dtype(dtype).itemsize
    total = output + working
    budget = get_memory_budget()
    if total > budget:
        if into_out:
            need = f"{format_bytes(working)} of working memory (the result goes into out=)"
        elif working:
            need = (f"{format_bytes(total)} ({format_bytes(output)} for the result, {format_bytes(working)} "
                    "of working memory)")
        else:
            need = format_bytes(total)
        raise OutputTooLargeError(
            f"{what} of shape {tuple(shape)} needs {need}, more than the memory budget of "
            f"{format_bytes(budget)}; {alternative} (or raise the budget with "
            "blockhess.set_memory_budget or BLOCKHESS_MEMORY_BUDGET)"
        )
    return total


def require_finite(result: Any, what: str) -> Any:
    """``result`` unless it holds Inf or NaN, which finite inputs can still produce when they drive a
    stage past the float range: then NonFiniteError naming ``what``."""
    if hasattr(result, "__cuda_array_interface__"):
        finite = bool(_xp(result).isfinite(result).all())
    else:
        finite = _core.all_finite(result)
    if not finite:
        raise NonFiniteError(
            f"{what} is not finite (Inf or NaN) although every input is: the inputs drive it past the "
            f"range of {np.dtype(result.dtype).name}; rescale them (inputs or weights of smaller magnitude)"
        )
    return result
