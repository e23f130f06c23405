"""What researchers hold, in and out: PyTorch tensors, masked arrays, np.matrix.

Every array argument passes through :func:`as_array`, which turns a PyTorch tensor into the array
blockhess computes on without copying (a CPU tensor into a NumPy view, a CUDA tensor into a CuPy
view), nested lists and tuples into a NumPy array (as ``np.asarray`` reads them), and refuses a
masked array (blockhess would silently compute on the values under the mask). Every public
function is wrapped by :func:`returns_callers_kind`, which gives results back as PyTorch tensors
(sharing memory with the computed arrays) whenever an argument was a tensor.
torch is never imported here unless the caller passed a tensor.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

import numpy as np

F = TypeVar("F", bound=Callable[..., Any])


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach") and hasattr(x, "is_cuda")


def as_array(x: Any, name: str) -> Any:
    """x as a NumPy or CuPy array (or x unchanged when it is neither a tensor, a list or tuple, nor a
    special array)."""
    if is_torch_tensor(x):
        return _from_torch(x, name)
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except (ValueError, TypeError) as err:  # ragged nesting, or items NumPy cannot hold
            raise TypeError(f"{name} must be a numeric array: {err}") from None
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} is a masked array; blockhess does not apply masks (it would compute on the "
            f"values under the mask): pass {name}.filled(value) or {name}.data"
        )
    if isinstance(x, np.matrix):
        return np.asarray(x)
    return x


def _from_torch(t: Any, name: str) -> Any:
    t = t.detach()
    if t.is_complex() or t.is_conj():
        raise TypeError(f"{name} must have dtype float32 or float64, got {t.dtype}")
    if t.is_cuda:
        return t  # a CUDA tensor exposes __cuda_array_interface__; the CuPy path takes it as it is
    if t.device.type != "cpu":
        raise TypeError(f"{name} is a torch tensor on {t.device}; blockhess takes CPU and CUDA tensors")
    try:
        return t.numpy()  # shares memory with the tensor
    except TypeError:  # bfloat16 and other types NumPy lacks
        raise TypeError(f"{name} must have dtype float32 or float64, got {t.dtype}") from None


def holds_torch(*values: Any) -> bool:
    """Whether any of ``values`` is a torch tensor, a list or tuple holding one (head=(W_C, b_C)),
    or a BlockParams built from tensors."""
    for value in values:
        if isinstance(value, (list, tuple)):
            # A sequence of arrays is looked through (one level); a nested list of numbers is data,
            # never walked element by element.
            if value and hasattr(value[0], "shape") and any(is_torch_tensor(v) for v in value):
                return True
        elif is_torch_tensor(value) or getattr(value, "_from_torch", False):
            return True
    return False


def to_torch(result: Any) -> Any:
    """result with every NumPy / CuPy array turned into a torch tensor sharing its memory."""
    import torch

    if isinstance(result, np.ndarray):
        if not result.flags.writeable:  # torch.from_numpy warns on read-only memory
            result = result.copy()
        return torch.from_numpy(result)
    if hasattr(result, "__cuda_array_interface__") and hasattr(result, "__dlpack__"):
        return torch.from_dlpack(result)
    if isinstance(result, tuple):
        return tuple(to_torch(r) for r in result)
    if isinstance(result, dict):
        return {k: to_torch(v) for k, v in result.items()}
    return result


def returns_callers_kind(func: F) -> F:
    """Give results back as torch tensors when any argument was one (an ``out=`` tensor is
    returned as the very tensor that was passed in)."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        if not holds_torch(*args, *kwargs.values()):
            return result
        out = kwargs.get("out")
        if out is None and "out" in signature.parameters:
            bound = signature.bind_partial(*args, **kwargs)
            out = bound.arguments.get("out")
        if is_torch_tensor(out) and not isinstance(result, dict):
            return out
        return to_torch(result)

    return wrapper  # type: ignore[return-value]
