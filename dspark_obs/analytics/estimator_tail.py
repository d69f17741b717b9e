"""Tail models of the block-accept estimator: acceptance of trimmed drafts nothing resolved.

A censored block's offsets past its last resolved one (after a divergence, or when the
request ended first) have no target log-prob, so their conditional acceptance r_j comes
from a model. Compact's budget trims the blocks whose survival is lowest, so the blocks that
need a tail are the low-confidence ones: per-position acceptance measured on the verified
windows overstates them (issue 21: +11% at 3/4 of blocks censored), while the head's own
confidence, even after STS, is only as calibrated as its training traffic. So the default
conditions each offset on the block's own confidence and fits that map on this run's data,
including the trimmed offsets later rows did resolve (their exact acceptance a_k), which is
where the selection acts.

Models (``TAIL_MODELS``):

* ``calibrated``: logit r_j = alpha_j + beta * logit(c_j) (c_j: the block's confidence at
  draft position j after STS). Penalized maximum likelihood (soft labels: 0/1 for verified
  at-risk positions, a_k for resolved trimmed offsets) with a Gaussian prior centred on the
  head as it is (alpha = 0, beta = 1), so little data means "trust the head". Its Laplace
  posterior gives parameter draws: intervals then carry the tail model's uncertainty.
* ``confidence``: r_j = c_j (optionally re-scaled by STS temperatures), no fitted part.
* ``empirical``: per workload and position acceptance of the verified positions (pooled
  over workloads where a workload has none).
* ``auto``: the one of the three with the lowest cross-validated log loss (folds of whole
  requests) on the resolved trimmed offsets, i.e. judged where the tail model is used;
  ``calibrated`` when there are too few requests or offsets to cross-validate.
* ``none``: no fill (point = the bracket's lower end).

Parameter draws (:meth:`TailModel.draws`) refit the fitted models on whole requests resampled
with replacement, so intervals carry the tail model's own uncertainty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

TAIL_MODELS = ("auto", "calibrated", "confidence", "empirical", "none")
FITTED = ("calibrated", "confidence", "empirical")

PRIOR_SD_ALPHA = 1.0
"""Prior sd of the per-position intercepts (logit scale) around the head's own value."""
PRIOR_SD_BETA = 0.5
"""Prior sd of the confidence slope around 1 (the head taken as calibrated)."""
CONF_CLIP = 1e-4
CV_FOLDS = 5
CV_MIN_REQUESTS = 4
CV_MIN_OFFSETS = 20

OBS_COLUMNS = ("request", "workload", "position", "conf", "y", "resolved")
"""Tail-model observations: request key, workload, draft position j (1-based), the block's
c_j, the label (0/1 verified, or a_k in [0, 1] resolved) and whether it is a resolved
trimmed offset."""


def _logit(c: np.ndarray) -> np.ndarray:
    c = np.clip(np.asarray(c, dtype=np.float64), CONF_CLIP, 1.0 - CONF_CLIP)
    return np.log(c) - np.log1p(-c)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass
class TailModel:
    """A fitted tail model: MAP rates for the point estimate, parameter draws for intervals."""

    name: str
    gamma: int
    theta: np.ndarray | None = None  # calibrated: [alpha_1..alpha_gamma, beta]
    counts: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    """empirical: (accepted, at risk) per (workload, position); workload "" = pooled."""
    selection: dict[str, float] = field(default_factory=dict)
    """auto: cross-validated log loss per candidate (empty when not cross-validated)."""
    observations: int = 0
    resolved_offsets: int = 0
    data: pd.DataFrame | None = field(default=None, repr=False)
    """The observations it was fit on (what :meth:`draws` resamples)."""
    _draws: dict[tuple[int, int], list[Any]] = field(default_factory=dict, repr=False)

    def rates(
        self, position: np.ndarray, conf: np.ndarray, workload: np.ndarray, draw: Any = None
    ) -> np.ndarray:
        """r_j for offsets at 1-based ``position`` with the block's ``conf``; ``draw`` is one
        element of :meth:`draws` (None: the MAP / point rates). NaN conf -> pooled rate."""
        position = np.asarray(position, dtype=np.int64)
        conf = np.asarray(conf, dtype=np.float64)
        if self.name == "none":
            return np.zeros(position.shape)
        if self.name == "calibrated":
            th = self.theta if draw is None else draw
            alpha = th[np.clip(position - 1, 0, self.gamma - 1)]
            r = _sigmoid(alpha + th[-1] * _logit(np.nan_to_num(conf, nan=0.5)))
            return np.where(np.isnan(conf), _sigmoid(alpha), r)
        if self.name == "confidence":
            return np.clip(np.nan_to_num(conf, nan=0.0), 0.0, 1.0)
        table = self._empirical_table() if draw is None else draw
        pooled = np.array([table.get(("", j), 0.0) for j in range(self.gamma + 2)])
        wl = np.broadcast_to(np.asarray(workload).astype(str), position.shape)
        names, codes = np.unique(wl, return_inverse=True)
        per = np.array(
            [[table.get((str(w), j), pooled[j]) for j in range(self.gamma + 2)] for w in names]
        ).reshape(len(names), self.gamma + 2)
        return per[codes.reshape(position.shape), np.clip(position, 0, self.gamma + 1)]

    def _empirical_table(self) -> dict[tuple[str, int], float]:
        return {k: (a + 0.5) / (n + 1.0) for k, (a, n) in self.counts.items()}

    def draws(self, n: int, seed: int) -> list[Any]:
        """``n`` draws of the model's parameters: refits on the observations of whole
        requests resampled with replacement (the tail model's uncertainty, including how
        blocks of one request resemble each other); the MAP repeated when fixed."""
        if self.fixed or self.data is None or len(self.data) == 0:
            return [None] * n
        key = (int(n), int(seed))
        if key not in self._draws:  # summaries of several groups share one set of draws
            self._draws[key] = self._refits(n, seed)
        return self._draws[key]

    def _refits(self, n: int, seed: int) -> list[Any]:
        assert self.data is not None
        d = self.data
        reqs, codes = np.unique(d["request"].to_numpy().astype(str), return_inverse=True)
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7A11]))
        order = np.argsort(codes, kind="stable")
        starts = np.searchsorted(codes[order], np.arange(reqs.size))
        ends = np.searchsorted(codes[order], np.arange(reqs.size), side="right")
        pos = d["position"].to_numpy(np.int64)
        y = np.clip(d["y"].to_numpy(np.float64), 0.0, 1.0)
        if self.name == "calibrated":
            x = _design(pos, d["conf"].to_numpy(np.float64), self.gamma)
        else:
            names, wl = np.unique(d["workload"].to_numpy().astype(str), return_inverse=True)
            verified = ~d["resolved"].to_numpy(bool)
        out = []
        for _ in range(n):
            pick = rng.integers(0, reqs.size, reqs.size)
            rows = np.concatenate([order[starts[r] : ends[r]] for r in pick])
            if self.name == "calibrated":
                out.append(_newton(x[rows], y[rows], self.gamma, self.theta))
                continue
            rows = rows[verified[rows]]
            out.append(_rate_table(names, wl[rows], pos[rows], y[rows], self.gamma))
        return out

    @property
    def fixed(self) -> bool:
        """Whether draws carry no parameter uncertainty (confidence, none)."""
        return self.name in ("confidence", "none")

    def describe(self) -> dict[str, Any]:
        """What the report and dashboards show: the model, its fit, how it was chosen."""
        out: dict[str, Any] = {
            "tail_model": self.name,
            "observations": self.observations,
            "resolved_offsets": self.resolved_offsets,
        }
        if self.theta is not None:
            out["alpha"] = [float(x) for x in self.theta[:-1]]
            out["beta"] = float(self.theta[-1])
        if self.selection:
            out["cv_log_loss"] = dict(self.selection)
        return out


# ---------------------------------------------------------------- fitting


def _design(position: np.ndarray, conf: np.ndarray, gamma: int) -> np.ndarray:
    x = np.zeros((position.size, gamma + 1))
    x[np.arange(position.size), np.clip(position - 1, 0, gamma - 1)] = 1.0
    x[:, -1] = _logit(conf)
    return x


def _newton(x: np.ndarray, y: np.ndarray, gamma: int, start: np.ndarray | None) -> np.ndarray:
    """MAP of the penalized logistic model (Newton with step halving, so the penalized
    likelihood never drops)."""
    prior_mean = np.zeros(gamma + 1)
    prior_mean[-1] = 1.0
    prior_prec = np.diag([PRIOR_SD_ALPHA**-2] * gamma + [PRIOR_SD_BETA**-2])
    th = prior_mean.copy() if start is None else np.array(start, dtype=np.float64)

    def objective(t: np.ndarray) -> float:
        z = x @ t
        d = t - prior_mean
        return float((y * z - np.logaddexp(0.0, z)).sum() - 0.5 * d @ prior_prec @ d)

    best = objective(th)
    for _ in range(100):
        p = _sigmoid(x @ th)
        grad = x.T @ (y - p) - prior_prec @ (th - prior_mean)
        hess = (x * (p * (1.0 - p))[:, None]).T @ x + prior_prec
        step = np.linalg.solve(hess, grad)
        value = objective(th + step)
        for _ in range(30):
            if value >= best - 1e-12:
                break
            step = 0.5 * step
            value = objective(th + step)
        th, best = th + step, max(best, value)
        if np.max(np.abs(step)) < 1e-8:
            break
    return th


def fit_calibrated(obs: pd.DataFrame, gamma: int, start: np.ndarray | None = None) -> TailModel:
    """Penalized logistic fit of logit r = alpha_j + beta logit(c_j), soft labels."""
    o = obs.loc[np.isfinite(obs["conf"].to_numpy(np.float64))]
    x = _design(o["position"].to_numpy(np.int64), o["conf"].to_numpy(np.float64), gamma)
    y = np.clip(o["y"].to_numpy(np.float64), 0.0, 1.0)
    return TailModel(
        "calibrated",
        gamma,
        theta=_newton(x, y, gamma, start),
        observations=int(len(o)),
        resolved_offsets=int(o["resolved"].sum()),
        data=o,
    )


def _rate_table(
    names: np.ndarray, wl: np.ndarray, pos: np.ndarray, y: np.ndarray, gamma: int
) -> dict[tuple[str, int], float]:
    """Smoothed acceptance (a + 0.5) / (n + 1) per (workload, position), "" = pooled."""
    table: dict[tuple[str, int], float] = {}
    size = gamma + 2
    pos = np.clip(pos, 0, gamma + 1)
    n_all = np.bincount(pos, minlength=size)
    a_all = np.bincount(pos, weights=y, minlength=size)
    flat = wl * size + pos
    n_wl = np.bincount(flat, minlength=names.size * size).reshape(names.size, size)
    a_wl = np.bincount(flat, weights=y, minlength=names.size * size).reshape(names.size, size)
    for j in np.flatnonzero(n_all):
        table[("", int(j))] = float((a_all[j] + 0.5) / (n_all[j] + 1.0))
    for w, j in zip(*np.nonzero(n_wl), strict=True):
        table[(str(names[w]), int(j))] = float((a_wl[w, j] + 0.5) / (n_wl[w, j] + 1.0))
    return table


def fit_empirical(obs: pd.DataFrame, gamma: int) -> TailModel:
    """Per workload and position acceptance of the verified at-risk positions."""
    v = obs.loc[~obs["resolved"].to_numpy(bool)]
    counts: dict[tuple[str, int], tuple[float, float]] = {}
    for (wl, pos), g in v.groupby(["workload", "position"], sort=True):
        counts[(str(wl), int(pos))] = (float(g["y"].sum()), float(len(g)))
    for pos, g in v.groupby("position", sort=True):
        counts[("", int(pos))] = (float(g["y"].sum()), float(len(g)))
    return TailModel(
        "empirical",
        gamma,
        counts=counts,
        observations=int(len(v)),
        resolved_offsets=int(obs["resolved"].sum()),
        data=obs,
    )


def fit_tail(name: str, obs: pd.DataFrame, gamma: int, seed: int = 0) -> TailModel:
    """Fit ``name`` (see ``TAIL_MODELS``) on tail observations (``OBS_COLUMNS``)."""
    if name not in TAIL_MODELS:
        raise ValueError(f"tail must be one of {list(TAIL_MODELS)}, got {name!r}")
    n_res = int(obs["resolved"].sum()) if len(obs) else 0
    if name == "none":
        return TailModel("none", gamma, observations=len(obs), resolved_offsets=n_res)
    if name == "confidence":
        return TailModel("confidence", gamma, observations=len(obs), resolved_offsets=n_res)
    if name == "empirical":
        return fit_empirical(obs, gamma)
    if name == "calibrated":
        return fit_calibrated(obs, gamma)
    scores = cross_validate(obs, gamma, seed)
    if not scores:
        return fit_calibrated(obs, gamma)
    best = min(FITTED, key=lambda m: scores[m])
    model = fit_tail(best, obs, gamma)
    model.selection = scores
    return model


def _log_loss(y: np.ndarray, r: np.ndarray) -> float:
    r = np.clip(r, 1e-6, 1.0 - 1e-6)
    return float(-np.mean(y * np.log(r) + (1.0 - y) * np.log1p(-r)))


def cross_validate(obs: pd.DataFrame, gamma: int, seed: int = 0) -> dict[str, float]:
    """Held-out log loss per candidate on the resolved trimmed offsets, folds of requests;
    empty when there are fewer than ``CV_MIN_REQUESTS`` requests or ``CV_MIN_OFFSETS``
    resolved offsets with a confidence."""
    res = obs["resolved"].to_numpy(bool) & np.isfinite(obs["conf"].to_numpy(np.float64))
    reqs = np.unique(obs["request"].to_numpy())
    if reqs.size < CV_MIN_REQUESTS or res.sum() < CV_MIN_OFFSETS:
        return {}
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0xC5]))
    fold_of = dict(zip(rng.permutation(reqs), np.arange(reqs.size) % CV_FOLDS, strict=True))
    fold = obs["request"].map(fold_of).to_numpy()
    losses: dict[str, list[np.ndarray]] = {m: [] for m in FITTED}
    ys: list[np.ndarray] = []
    for f in range(min(CV_FOLDS, reqs.size)):
        test = (fold == f) & res
        if not test.any():
            continue
        train, held = obs.loc[fold != f], obs.loc[test]
        ys.append(held["y"].to_numpy(np.float64))
        for m in FITTED:
            model = fit_tail(m, train, gamma)
            losses[m].append(
                model.rates(
                    held["position"].to_numpy(np.int64),
                    held["conf"].to_numpy(np.float64),
                    held["workload"].to_numpy(),
                )
            )
    y = np.concatenate(ys)
    return {m: _log_loss(y, np.concatenate(losses[m])) for m in FITTED}
