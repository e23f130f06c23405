"""One bound of the paper next to the exact value it bounds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Bound:
    """An exact quantity, the paper's bound on it as stated, and a bound that provably holds.

    ``stated`` is None where the paper gives no bound for the quantity (e.g. the (K,K) block of
    Thm 1); ``erratum`` names the entry of docs/errata.md the corrected form fixes (None where the
    stated form is already valid and the corrected one only tightens or restates it). ``extra``
    holds other readings of the stated bound (e.g. Lemma 4 with the row std in place of the
    printed row norm).
    """

    quantity: str
    exact: float
    stated: float | None
    corrected: float
    erratum: str | None = None
    source: str = ""
    extra: dict[str, float] = field(default_factory=dict)

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
