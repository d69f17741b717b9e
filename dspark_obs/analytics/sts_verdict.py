"""Whether a set of STS temperatures may be served: one verdict for the CLI, report and pages.

Two things make a fitted STS untrustworthy, and a reader must see them next to the numbers
(never only a download link): it was judged on too few requests, or it made the calibration
worse. Worse wins: a harmful STS is "do not serve" however many requests judged it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["MIN_HELDOUT_REQUESTS", "OK", "TOO_FEW", "WORSE", "StsVerdict", "sts_verdict"]

MIN_HELDOUT_REQUESTS = 20
"""Fewer judging requests than this and the ECE comparison is flagged as untrustworthy."""

OK = "ok"
TOO_FEW = "too few to trust"
WORSE = "worse: do not serve"


@dataclass(frozen=True)
class StsVerdict:
    """``status``: ok | too few to trust | worse: do not serve; ``reasons``: the sentences."""

    status: str
    reasons: list[str] = field(default_factory=list)

    @property
    def servable(self) -> bool:
        """Only an STS that did not make calibration worse may be offered for serving."""
        return self.status != WORSE

    def line(self) -> str:
        """One line for a terminal or a caption: the status, then why."""
        return self.status if not self.reasons else f"{self.status}: " + "; ".join(self.reasons)


def _fmt(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else "nan"


def _interval(template: str, ci: tuple[float, float]) -> str:
    """``template`` filled with the interval's ends; empty unless both are finite."""
    return template.format(*ci) if all(math.isfinite(c) for c in ci) else ""


def sts_verdict(
    ece_before: float,
    ece_after: float,
    judged_requests: int,
    *,
    fit_requests: int | None = None,
    after_ci: tuple[float, float] = (math.nan, math.nan),
    change_ci: tuple[float, float] = (math.nan, math.nan),
    judged_on: str = "held-out",
) -> StsVerdict:
    """The verdict on temperatures that took ECE from ``ece_before`` to ``ece_after`` when
    judged on ``judged_requests`` requests (``judged_on`` names which: held-out, or all)."""
    reasons = []
    few = judged_requests < MIN_HELDOUT_REQUESTS
    if few:
        fit = f" (fit on {fit_requests})" if fit_requests is not None else ""
        ci = _interval(", 95% interval [{:.4f}, {:.4f}]", after_ci)
        reasons.append(
            f"judged on only {judged_requests} {judged_on} request(s){fit}: ECE after "
            f"{_fmt(ece_after)}{ci}; too few to trust (want >= {MIN_HELDOUT_REQUESTS})"
        )
    worse = math.isfinite(ece_before) and math.isfinite(ece_after) and ece_after > ece_before
    if worse:
        ci = _interval(" (change interval [{:+.4f}, {:+.4f}])", change_ci)
        reasons.append(
            f"ECE after STS {_fmt(ece_after)} is WORSE than before {_fmt(ece_before)} on "
            f"{judged_on} requests{ci}; do not serve these"
        )
    status = WORSE if worse else TOO_FEW if few else OK
    return StsVerdict(status, reasons)
