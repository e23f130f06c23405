"""blockhess's own exceptions. Both are ValueErrors, so ``except ValueError`` still catches them."""

from __future__ import annotations


class OutputTooLargeError(MemoryError, ValueError):
    """A call's result and working memory would exceed the memory budget. Both a MemoryError and a
    ValueError."""


class NonFiniteError(ValueError):
    """A result, or a stage on the way to it, is Inf or NaN although every input is finite: the
    inputs drive it past the float range. The message names the stage. (The C++ core raises it
    as blockhess::non_finite_error.)"""


OutputTooLargeError.__module__ = NonFiniteError.__module__ = "blockhess"
