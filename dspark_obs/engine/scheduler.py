"""DSpark verify scheduling: the SPS-argmax token budget and its per-request allocation.

Semantics follow SGLang 0.5.23's DSpark planner (``dspark_planner.py`` and the top-k
scheduler kernel), so a trace replayed here picks the same budgets and windows:

* Survival entries below ``survival_eps`` (1e-6) are not candidates: they add nothing to
  tau, they are never allocated, and the budget search stops at the number of candidates.
  DESIGN.md's "b in 0..bs*gamma" is the eps = 0 special case.
* The budget is the first maximum of ``tau(b) / T(bs, b)`` (additive table) or
  ``tau(b) * SPS(bs + b)`` (1-D table) over ``b = 0..#candidates``, in float64.
* The budget uses the survival of ``lag`` plan calls ago; the allocation uses the current
  survival. A request with no survival from ``lag`` calls ago is treated as all-ones
  (SGLang: the request-pool slot's generation does not match, so it substitutes ones).
* Allocation ranks all candidates by (higher value, lower position, lower request index),
  takes the first ``b`` and sets ``verify_len = 1 + (number taken from that request)``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from dspark_obs.cost_table import CostTable

__all__ = [
    "SURVIVAL_EPS",
    "BudgetDecision",
    "ConfidenceRelay",
    "Scheduler",
    "SurvivalError",
    "allocate",
    "sps_budget",
    "sps_decision",
]

SURVIVAL_EPS = 1e-6
"""SGLang's ``DSparkScheduleConfig.survival_eps``: smaller survivals are never verified."""


@dataclass(frozen=True)
class BudgetDecision:
    """One budget choice with what the table predicted for it (DecodeStepRecord fields)."""

    budget: int
    predicted_step_seconds: float | None = None
    predicted_theta: float | None = None
    """Objective at the chosen budget: predicted committed tokens per second."""


class SurvivalError(ValueError):
    """Survival / confidence that is not a probability: the message names row and position."""


def _as_survival(survival: np.ndarray, name: str = "survival") -> np.ndarray:
    arr = np.asarray(survival)
    if arr.ndim != 2:
        raise SurvivalError(f"{name} must be 2-D [bs, gamma], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        try:
            arr = arr.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise SurvivalError(f"{name} must hold numbers ({exc})") from None
    bad = ~((arr >= 0) & (arr <= 1))  # NaN fails both comparisons
    if bad.any():
        row, pos = (int(x) for x in np.argwhere(bad)[0])
        raise SurvivalError(
            f"{name}[{row}, {pos}] = {float(arr[row, pos])}: survival and confidence must be "
            f"probabilities in [0, 1] ({int(bad.sum())} bad value(s))"
        )
    return arr


def _valid(arr: np.ndarray, survival_eps: float) -> np.ndarray:
    # Compare in the input's own precision, as SGLang compares its float32 survival.
    return arr >= arr.dtype.type(survival_eps)


def sps_decision(
    survival: np.ndarray, table: CostTable, *, survival_eps: float = SURVIVAL_EPS
) -> BudgetDecision:
    """The SPS-argmax budget for a batch, with the table's prediction at that budget.

    ``survival`` is ``[bs, gamma]`` (normally the lagged survival). Ties pick the smallest
    budget: ``np.argmax`` returns the first maximum, as ``torch.argmax`` does in SGLang.
    """
    arr = _as_survival(survival)
    bs = arr.shape[0]
    if bs == 0:
        return BudgetDecision(budget=0)
    cand = arr[_valid(arr, survival_eps)].astype(np.float64)
    tau = bs + np.concatenate(([0.0], np.cumsum(np.sort(cand)[::-1])))
    score = table.objective(bs, tau)
    idx = int(np.argmax(score))
    step = float(table.predicted_step_seconds(bs, np.array([idx]))[0])
    return BudgetDecision(
        budget=idx, predicted_step_seconds=step, predicted_theta=float(score[idx])
    )


def sps_budget(
    survival: np.ndarray, table: CostTable, *, survival_eps: float = SURVIVAL_EPS
) -> int:
    """Extra verify tokens for the batch: the first ``b`` maximizing predicted tokens/sec."""
    return sps_decision(survival, table, survival_eps=survival_eps).budget


def allocate(survival: np.ndarray, b: int, *, survival_eps: float = SURVIVAL_EPS) -> np.ndarray:
    """``verify_len`` per request (anchor included): ``b`` slots to the top-``b`` survivals.

    Ranking: higher value first, then lower position, then lower request index. A request's
    window must be a prefix of its block, so its ``verify_len`` is ``1 +`` the *number* of its
    entries among the top ``b`` (SGLang's rule), not the positions of those entries. For a
    real survival row (a cumulative product of confidences in [0, 1], non-increasing even after
    float rounding, since rounding is monotone) the top entries of a request *are* a prefix:
    equal values are ranked by lower position first. If a caller passes a row that increases
    somewhere, the count rule still verifies exactly ``b`` drafts in total, just as SGLang
    would; we do not reorder or repair such rows.
    """
    arr = _as_survival(survival)
    bs, gamma = arr.shape
    lens = np.ones(bs, dtype=np.int64)
    if b <= 0 or bs == 0 or gamma == 0:
        return lens
    valid = _valid(arr, survival_eps).ravel()
    vals = np.where(valid, arr.astype(np.float64).ravel(), -np.inf)
    pos = np.tile(np.arange(gamma), bs)
    req = np.repeat(np.arange(bs), gamma)
    order = np.lexsort((req, pos, -vals))  # last key is the primary one
    take = order[: min(int(b), vals.size)]
    take = take[valid[take]]
    lens += np.bincount(req[take], minlength=bs)
    return np.clip(lens, 1, gamma + 1)


class ConfidenceRelay:
    """Per-request survival history, returning what each request had ``lag`` calls ago.

    Call :meth:`step` once per decode step with the whole running batch. A request that is
    absent from a call loses its history (it left: finished or was preempted), so if it comes
    back it starts fresh, like an SGLang request that gets a new pool slot (new generation).
    A request without a survival from exactly ``lag`` calls ago (it joined less than ``lag``
    calls ago) gets all-ones survival, which is what SGLang substitutes on a generation
    mismatch: it is assumed to accept every draft until its own history arrives.

    SGLang's effective lag is ``max(SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS, 1)`` without the
    overlap scheduler and ``max(that, 2)`` with it; here ``lag`` is taken literally and may be
    0 (budget from the current survival). Under overlap SGLang also returns no budget for the
    first two decode steps of the server's life (verify-all); this synchronous relay has no
    such warm-up and gives all-ones rows instead, as SGLang's non-overlap path does.
    """

    def __init__(self, lag: int = 2) -> None:
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        self._lag = int(lag)
        # One snapshot per call (the call's row of each request, and its survival array), the
        # last lag + 1 calls; and for each request of the last call, how many calls in a row
        # it has been in. A request's row from k calls back exists iff that run is > k: the
        # whole history is two dict builds and one gather per call, not a deque per request.
        self._snaps: deque[tuple[dict[Hashable, int], np.ndarray]] = deque(maxlen=self._lag + 1)
        self._run: dict[Hashable, int] = {}
        self._gamma: int | None = None

    @property
    def lag(self) -> int:
        return self._lag

    def __len__(self) -> int:
        return len(self._run)

    def reset(self) -> None:
        """Forget everything (e.g. between runs)."""
        self._snaps.clear()
        self._run = {}
        self._gamma = None

    def _lagged(self, rids: Sequence[Hashable], back: int, gamma: int) -> np.ndarray:
        """``[bs, gamma]``: each request's row of the snapshot ``back`` calls from the newest
        (1: the newest), where the request has been in every call since; ones elsewhere."""
        out = np.ones((len(rids), gamma), dtype=np.float64)
        if back > len(self._snaps) or not len(rids):
            return out
        index, rows = self._snaps[-back]
        run = self._run
        have = np.flatnonzero(np.fromiter((run.get(r, 0) >= back for r in rids), bool, len(rids)))
        if len(have):
            src = np.fromiter((index[rids[i]] for i in have.tolist()), np.int64, len(have))
            out[have] = rows[src]
        return out

    def peek(self, rids: Sequence[Hashable], gamma: int, pending: int = 0) -> np.ndarray | None:
        """What :meth:`step` will return for this batch, before its current survival is known,
        with ``pending`` earlier steps (of the same requests) not recorded yet (None when that
        needs a survival nobody has: ``lag`` <= ``pending``)."""
        if self._lag <= pending:
            return None
        return self._lagged(rids, self._lag - pending, gamma)

    def step(self, rids: Sequence[Hashable], survival_now: np.ndarray) -> np.ndarray:
        """Record this step's survival and return the lagged ``[bs, gamma]`` survival (float64)."""
        arr = _as_survival(survival_now, "survival_now")
        bs, gamma = arr.shape
        if len(rids) != bs:
            raise ValueError(f"{len(rids)} request ids for {bs} survival rows")
        index = dict(zip(rids, range(bs), strict=True))
        if len(index) != bs:
            raise ValueError("duplicate request ids in one step")
        if self._gamma is not None and gamma != self._gamma and bs:
            raise ValueError(f"survival width changed from {self._gamma} to {gamma}")
        if bs:
            self._gamma = gamma
        run = self._run
        self._run = {rid: run.get(rid, 0) + 1 for rid in rids}
        self._snaps.append((index, np.array(arr, dtype=np.float64)))  # a copy: no aliasing
        return self._lagged(rids, self._lag + 1, gamma)


class Scheduler:
    """Per-step planner: budget from lagged survival, windows from the current survival.

    Without a cost table it verifies everything (``verify_len = gamma + 1`` for all,
    ``budget = bs * gamma``), which is SGLang's behaviour in compact mode with no SPS table.
    A 1-D table with at most one probe is SGLang's *uninitialized* table (flat steps/sec):
    SGLang's planner then verifies everything in compact mode, and so does this one (in
    cap-accept too, so a companion keeps committing what its compact run commits).
    ``forced_budget_frac`` pins the budget to ``int(frac * bs * gamma)`` (SGLang's
    ``dspark_force_budget_frac``), used to profile step times over varied K; it applies with
    or without a table here, since the embedded profiler has no table yet.
    """

    def __init__(
        self,
        table: CostTable | None,
        gamma: int,
        lag: int = 2,
        *,
        survival_eps: float = SURVIVAL_EPS,
    ) -> None:
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.table = table
        self.gamma = int(gamma)
        self.survival_eps = float(survival_eps)
        self.relay = ConfidenceRelay(lag)
        self.forced_budget_frac: float | None = None
        self.last_decision: BudgetDecision | None = None

    def reset(self) -> None:
        """Forget every request's history (a new run starts)."""
        self.relay.reset()

    @property
    def survival_floor(self) -> float | None:
        """The survival below which a full budget still leaves a draft unverified (the
        ``survival_eps`` floor), or None when a full budget verifies every draft (no table:
        :meth:`plan` then skips the allocation)."""
        if self.forced_budget_frac is None and (self.table is None or self.table.uninitialized):
            return None
        return self.survival_eps

    def decide_ahead(self, rids: Sequence[Hashable], pending: int = 0) -> BudgetDecision | None:
        """The budget :meth:`plan` will pick for this batch, known before the step drafts (the
        budget reads lagged survival only), with ``pending`` earlier steps still to be planned;
        None when it needs a survival not known yet (``lag`` <= ``pending``). Hand it to
        :meth:`plan` as ``decision``. A full budget lets a step verify every block without
        waiting for the drafts."""
        bs = len(rids)
        frac = self.forced_budget_frac
        if frac is not None:
            return BudgetDecision(budget=max(0, int(float(frac) * bs * self.gamma)))
        if self.table is None or self.table.uninitialized:
            return BudgetDecision(budget=bs * self.gamma)
        lagged = self.relay.peek(rids, self.gamma, pending)
        if lagged is None:
            return None
        return sps_decision(lagged, self.table, survival_eps=self.survival_eps)

    def plan(
        self,
        rids: Sequence[Hashable],
        survival_now: np.ndarray,
        decision: BudgetDecision | None = None,
    ) -> tuple[int, np.ndarray]:
        """``(budget, verify_lens)`` for this step; also sets :attr:`last_decision`.
        ``decision``: the budget :meth:`decide_ahead` gave before the step drafted (the step
        launched with it, possibly for more requests than are left now)."""
        arr = _as_survival(survival_now, "survival_now")
        bs, gamma = arr.shape
        if gamma != self.gamma:
            raise ValueError(f"survival has {gamma} positions, scheduler gamma is {self.gamma}")
        frac = self.forced_budget_frac
        if frac is not None:
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"forced_budget_frac must be in [0, 1], got {frac}")
            if self.table is not None:
                self.relay.step(rids, arr)
            budget = max(0, int(float(frac) * bs * gamma))
            self.last_decision = BudgetDecision(budget=budget)
            return budget, allocate(arr, budget, survival_eps=self.survival_eps)
        if self.table is None or self.table.uninitialized:
            self.last_decision = None
            return bs * gamma, np.full(bs, gamma + 1, dtype=np.int64)
        lagged = self.relay.step(rids, arr)
        if decision is None:
            decision = sps_decision(lagged, self.table, survival_eps=self.survival_eps)
        self.last_decision = decision
        budget = min(decision.budget, bs * gamma)  # requests that left since it was decided
        return budget, allocate(arr, budget, survival_eps=self.survival_eps)
