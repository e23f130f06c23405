"""One bound of the paper next to the exact value it bounds."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .._errors import NonFiniteError


@dataclass(frozen=True)
class Bound:
    """An exact quantity, the paper's bound on it as stated, and a bound that provably holds.

    ``stated`` is None where the paper gives no bound for the quantity (e.g. the (K,K) block of
    Thm 1); ``erratum`` names the entry of docs/errata.md the corrected form fixes (None where the
    stated form is already valid and the corrected one only tightens or restates it). ``extra``
    holds other readings of the stated bound (e.g. Lemma 4 with the row std in place of the
    printed row norm).

    A bound past the float64 range is inf: it still holds, vacuously. (The inputs are finite, so a
    NaN bound can only come from such an overflow, e.g. inf * 0, and is read as inf too.) The exact
    value must be finite: NonFiniteError otherwise.
    """

    quantity: str
    exact: float
    stated: float | None
    corrected: float
    erratum: str | None = None
    source: str = ""
    extra: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        exact = float(self.exact)
        if not math.isfinite(exact):
            raise NonFiniteError(f"{self.quantity}: the exact value is {exact}, past the float64 range; rescale the "
                                 "inputs (or weights) to smaller magnitudes")
        object.__setattr__(self, "exact", exact)
        object.__setattr__(self, "stated", None if self.stated is None else as_bound(self.stated))
        object.__setattr__(self, "corrected", as_bound(self.corrected))
        object.__setattr__(self, "extra", {key: as_bound(value) for key, value in self.extra.items()})

    @property
    def stated_holds(self) -> bool | None:
        """Whether the paper's bound holds here (None: the paper gives none)."""
        return None if self.stated is None else bool(self.exact <= self.stated * (1 + 1e-12))

    @property
    def corrected_holds(self) -> bool:
        return bool(self.exact <= self.corrected * (1 + 1e-12))

    @property
    def tightness(self) -> float:
        """exact / corrected: 1 is tight, small is loose."""
        return self.exact / self.corrected if self.corrected > 0 else (1.0 if self.exact == 0 else float("inf"))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(stated_holds=self.stated_holds, corrected_holds=self.corrected_holds, tightness=self.tightness)
        return out


def as_bound(value: float) -> float:
    """A bound's value as a float, NaN (an overflowed intermediate, see :class:`Bound`) as inf."""
    value = float(value)
    return math.inf if math.isnan(value) else value
