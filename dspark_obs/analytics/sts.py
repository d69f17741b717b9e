"""Sequential temperature scaling (STS) of the confidence head, SGLang-compatible.

The fitter is SGLang 0.5.23's (benchmark/dspark_sts_fit.py), restated: positions in order;
for position k the candidate temperatures are the 41 values of
``torch.logspace(log10(0.1), log10(10), 41)`` (float32, as SGLang builds them, so fitted
values read e.g. 0.10000000149011612); each candidate gives the cumulative survival
``S_k = S_{k-1}^fitted * sigmoid(z_k / T)`` and its ECE (15 equal-width bins) against the
prefix label; the first candidate with the strictly smallest ECE wins. ``ece_before`` is the
same ECE for T = 1 at every position. Confidence at serve time: c_k = sigmoid(z_k / T_k).

One addition: an ``observed`` mask, so compact-mode data (positions past a fully accepted
window are unobserved) can be fitted without counting them as rejections. With no mask the
result is SGLang's. A position with no observed sample keeps T = 1 (SGLang never meets one).

Files: the STS JSON ``{"temperatures", "dataset", "num_samples", "ece_before",
"ece_after"}`` (SGLang requires only non-empty, all-positive temperatures; it ignores
unknown keys) and the collection shards ``stem.N.pt`` = torch.save({"logits": [n, gamma],
"prefix_mask": [n, gamma] = 1[k < correct_drafts]}).
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dspark_obs._jsonfile import read_json_file
from dspark_obs.analytics._frames import FrameLike, request_keys, text_column
from dspark_obs.analytics.calibration import N_BINS, ece, wide_labels
from dspark_obs.analytics.sts_verdict import MIN_HELDOUT_REQUESTS, StsVerdict, sts_verdict

GRID_SIZE = 41
# Confidences are stored rounded to 4 decimals; 0.0 / 1.0 would give infinite logits.
# Clamp half a rounding unit in from the ends.
CONF_EPS = 5e-5

MAX_GAMMA = 64
"""Most positions accepted from an STS file or shard (SGLang deploys gamma 5..7)."""

MAX_SHARD_BYTES = 4 * 2**30
"""Largest shard file loaded (4 GiB: ~150M rows at gamma 7)."""


class StsFileError(ValueError):
    """An STS JSON or shard that cannot be used; the message names the file and the problem."""


# ---------------------------------------------------------------- numerics


def temperature_grid(size: int = GRID_SIZE) -> np.ndarray:
    """SGLang's candidate temperatures (float32 logspace 0.1..10, widened to float64)."""
    try:
        import torch

        return (
            torch.logspace(math.log10(0.1), math.log10(10.0), steps=size).to(torch.float64).numpy()
        )
    except ImportError:  # pragma: no cover - torch is a project dependency
        return np.logspace(-1.0, 1.0, size, dtype=np.float32).astype(np.float64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function in float64; 1/(1+exp(-x)) as torch computes it (inf-safe)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def logit(conf: np.ndarray, eps: float = CONF_EPS) -> np.ndarray:
    """Raw confidence logit z from a stored confidence (clamped: stored values are rounded)."""
    c = np.clip(np.asarray(conf, dtype=np.float64), eps, 1.0 - eps)
    return np.log(c) - np.log1p(-c)


def apply_sts(conf_logits: np.ndarray, temperatures: Sequence[float] | np.ndarray) -> np.ndarray:
    """Calibrated confidences c_k = sigmoid(z_k / T_k) for z of shape [n, gamma] (or [gamma])."""
    z = np.asarray(conf_logits, dtype=np.float64)
    t = np.asarray(temperatures, dtype=np.float64)
    if z.shape[-1] != t.shape[-1]:
        raise ValueError(
            f"logits have {z.shape[-1]} positions but {t.shape[-1]} temperatures were given"
        )
    if not np.all(np.isfinite(t) & (t > 0)):
        raise ValueError(f"temperatures must all be finite and > 0, got {t.tolist()}")
    return sigmoid(z / t)


def survival(conf: np.ndarray) -> np.ndarray:
    """S_j = prod_{i<=j} c_i along the last axis."""
    return np.cumprod(np.asarray(conf, dtype=np.float64), axis=-1)


def position_ece(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    observed: np.ndarray | None = None,
    n_bins: int = N_BINS,
) -> np.ndarray:
    """Per-position ECE of the cumulative survival under ``temperatures`` (None: all 1)."""
    z = np.asarray(conf_logits, dtype=np.float64)
    gamma = z.shape[1]
    t = np.ones(gamma) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    s = survival(apply_sts(z, t))
    y = np.asarray(prefix_mask, dtype=np.float64)
    obs = np.ones_like(y, dtype=bool) if observed is None else np.asarray(observed, dtype=bool)
    return np.array([ece(s[obs[:, k], k], y[obs[:, k], k], n_bins) for k in range(gamma)])


def pooled_ece(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    temperatures: Sequence[float] | np.ndarray | None = None,
    observed: np.ndarray | None = None,
    n_bins: int = N_BINS,
) -> float:
    """ECE over all observed (sample, position) pairs at once: one number per data set."""
    z = np.asarray(conf_logits, dtype=np.float64)
    t = np.ones(z.shape[1]) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
    s = survival(apply_sts(z, t))
    y = np.asarray(prefix_mask, dtype=np.float64)
    obs = np.ones_like(y, dtype=bool) if observed is None else np.asarray(observed, dtype=bool)
    return ece(s[obs], y[obs], n_bins)


# ---------------------------------------------------------------- the calibration file


@dataclass
class StsCalibration:
    """SGLang's STS JSON, field for field."""

    temperatures: list[float]
    dataset: str = ""
    num_samples: int = 0
    ece_before: list[float] = field(default_factory=list)
    ece_after: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        problem = _temperature_problem(self.temperatures)
        if problem:
            raise StsFileError(f"<StsCalibration>: {problem}")

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object; an ECE list holding NaN is left out (SGLang's loader wants floats)."""
        out: dict[str, Any] = {
            "temperatures": [float(t) for t in self.temperatures],
            "dataset": str(self.dataset),
            "num_samples": int(self.num_samples),
        }
        for name in ("ece_before", "ece_after"):
            values = [float(v) for v in getattr(self, name)]
            if all(math.isfinite(v) for v in values):
                out[name] = values
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(
        cls, text: str, source: str = "<string>", gamma: int | None = None
    ) -> StsCalibration:
        """Parse and validate; every error names ``source`` and what is wrong."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise StsFileError(f"{source}: not valid JSON ({exc})") from None
        return cls.from_dict(data, source=source, gamma=gamma)

    @classmethod
    def from_dict(
        cls, data: Any, source: str = "<dict>", gamma: int | None = None
    ) -> StsCalibration:
        if not isinstance(data, Mapping):
            raise StsFileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if "temperatures" not in data:
            raise StsFileError(f"{source}: missing required key 'temperatures'")
        temps = data["temperatures"]
        problem = _temperature_problem(temps)
        if problem:
            raise StsFileError(f"{source}: {problem}")
        n = len(temps)
        if n > MAX_GAMMA:
            raise StsFileError(f"{source}: {n} temperatures; at most {MAX_GAMMA} positions")
        if gamma is not None and n != gamma:
            raise StsFileError(f"{source}: has {n} temperatures but gamma is {gamma}")
        dataset = data.get("dataset", "")
        if not isinstance(dataset, str):
            raise StsFileError(f"{source}: 'dataset' must be a string, got {_short(dataset)}")
        num = data.get("num_samples", 0)
        if isinstance(num, bool) or not isinstance(num, int) or num < 0:
            raise StsFileError(
                f"{source}: 'num_samples' must be a non-negative integer, got {_short(num)}"
            )
        lists = {}
        for name in ("ece_before", "ece_after"):
            v = data.get(name, [])
            if not isinstance(v, list) or any(
                isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1 for x in v
            ):
                raise StsFileError(f"{source}: '{name}' must be a list of ECE values in [0, 1]")
            if v and len(v) != n:
                raise StsFileError(
                    f"{source}: '{name}' has {len(v)} values but there are {n} temperatures"
                )
            lists[name] = [float(x) for x in v]
        return cls([float(t) for t in temps], dataset, num, lists["ece_before"], lists["ece_after"])

    @classmethod
    def load(cls, path: str | os.PathLike[str], gamma: int | None = None) -> StsCalibration:
        """Read and validate a file; any bytes give an :class:`StsFileError` naming it."""
        return cls.from_dict(read_json_file(path, StsFileError), source=str(path), gamma=gamma)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(v).__name__})"


def _temperature_problem(temps: Any) -> str | None:
    if not isinstance(temps, list | tuple) or len(temps) == 0:
        return "'temperatures' must be a non-empty list"
    for i, t in enumerate(temps):
        if isinstance(t, bool) or not isinstance(t, int | float | np.floating | np.integer):
            return f"temperatures[{i}] = {_short(t)} is not a number"
        if not 0 < t <= 1e30:  # compared exactly (a 400-digit int does not overflow); NaN fails
            return f"temperatures[{i}] = {_short(t)} must be finite and > 0"
    return None


# ---------------------------------------------------------------- fitting


def fit_sts(
    conf_logits: np.ndarray,
    prefix_mask: np.ndarray,
    observed: np.ndarray | None = None,
    grid: Sequence[float] | np.ndarray | None = None,
    n_bins: int = N_BINS,
    dataset: str = "",
) -> StsCalibration:
    """Fit per-position temperatures exactly as SGLang's fitter (plus the observed mask)."""
    z = np.asarray(conf_logits, dtype=np.float64)
    y = np.asarray(prefix_mask, dtype=np.float64)
    if z.ndim != 2 or z.shape != y.shape:
        raise ValueError(f"logits {z.shape} and prefix_mask {y.shape} must both be [n, gamma]")
    n, gamma = z.shape
    if n == 0:
        raise ValueError("fit_sts needs at least one sample")
    obs = np.ones((n, gamma), dtype=bool) if observed is None else np.asarray(observed, dtype=bool)
    candidates = [float(t) for t in (temperature_grid() if grid is None else grid)]
    temps, before, after = [], [], []
    s_raw = np.ones(n)
    s_fit = np.ones(n)
    for k in range(gamma):
        m = obs[:, k]
        yk = y[m, k]
        s_raw = s_raw * sigmoid(z[:, k])
        before.append(ece(s_raw[m], yk, n_bins))
        if not m.any():
            temps.append(1.0)
            after.append(float("nan"))
            s_fit = s_fit * sigmoid(z[:, k])
            continue
        best_t = candidates[0]
        best_s = s_fit * sigmoid(z[:, k] / best_t)
        best_e = ece(best_s[m], yk, n_bins)
        for t in candidates[1:]:
            cand = s_fit * sigmoid(z[:, k] / t)
            e = ece(cand[m], yk, n_bins)
            if e < best_e:
                best_t, best_s, best_e = t, cand, e
        temps.append(float(best_t))
        after.append(float(best_e))
        s_fit = best_s
    return StsCalibration(temps, dataset, int(n), before, after)


# ---------------------------------------------------------------- data sources


@dataclass
class StsData:
    """Inputs of a fit: raw logits z, prefix labels, what was observed, who each row belongs to."""

    logits: np.ndarray  # [n, gamma]
    prefix_mask: np.ndarray  # [n, gamma] float 0/1 (0 where unobserved)
    observed: np.ndarray  # [n, gamma] bool
    request: np.ndarray | None = None  # [n] request key, for splitting by request
    workload: np.ndarray | None = None  # [n]

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def subset(self, rows: np.ndarray) -> StsData:
        return StsData(
            self.logits[rows],
            self.prefix_mask[rows],
            self.observed[rows],
            None if self.request is None else self.request[rows],
            None if self.workload is None else self.workload[rows],
        )


def load_sts_shards(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> StsData:
    """Read SGLang collection shards (a glob or a list of paths), concatenated in sorted order."""

    if isinstance(paths, str | os.PathLike):
        files = sorted(glob.glob(str(paths)))
        if not files:
            raise StsFileError(f"{paths}: no STS shard matched")
    else:
        files = [str(p) for p in paths]
        if not files:
            raise StsFileError("no STS shard given")
    logits, masks, gamma = [], [], None
    for f in files:
        lg, pm = _read_shard(f)
        if gamma is None:
            gamma = lg.shape[1]
        elif lg.shape[1] != gamma:
            raise StsFileError(
                f"{f}: gamma {lg.shape[1]} disagrees with earlier shards' gamma {gamma}"
            )
        logits.append(lg)
        masks.append(pm)
    lg = np.concatenate(logits)
    pm = np.concatenate(masks)
    return StsData(lg, pm, np.ones(lg.shape, dtype=bool))


def _read_shard(f: str) -> tuple[np.ndarray, np.ndarray]:
    """One shard's (logits, prefix_mask) as float64 [n, gamma], validated field by field."""
    import torch

    try:
        size = os.path.getsize(f)
    except OSError as exc:
        raise StsFileError(f"{f}: cannot read ({exc.strerror or exc})") from None
    if size > MAX_SHARD_BYTES:
        raise StsFileError(f"{f}: {size} bytes, above the {MAX_SHARD_BYTES // 2**30} GiB cap")
    try:  # weights_only: a shard from outside must not run code while unpickling
        shard = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; name the file
        raise StsFileError(f"{f}: cannot load shard ({type(exc).__name__}: {exc})"[:500]) from None
    if not isinstance(shard, Mapping) or "logits" not in shard or "prefix_mask" not in shard:
        raise StsFileError(f"{f}: expected a dict with 'logits' and 'prefix_mask'")
    out = []
    for name in ("logits", "prefix_mask"):
        t = shard[name]
        if not isinstance(t, torch.Tensor):
            raise StsFileError(f"{f}: '{name}' must be a tensor, got {type(t).__name__}")
        if t.is_complex() or t.is_quantized or t.is_meta or t.layout != torch.strided:
            raise StsFileError(f"{f}: '{name}' has unusable dtype {t.dtype}")
        if t.ndim != 2 or not 1 <= t.shape[1] <= MAX_GAMMA:
            raise StsFileError(
                f"{f}: '{name}' must be [n, gamma] with gamma in 1..{MAX_GAMMA}, "
                f"got shape {tuple(t.shape)}"
            )
        out.append(t.detach().cpu().to(torch.float64).numpy())
    lg, pm = out
    if lg.shape != pm.shape:
        raise StsFileError(
            f"{f}: logits {lg.shape} / prefix_mask {pm.shape} must be equal [n, gamma]"
        )
    bad = ~np.isfinite(lg)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise StsFileError(
            f"{f}: 'logits' row {row} position {col} is {lg[row, col]}; "
            f"{int(bad.sum())} non-finite value(s)"
        )
    bad = (pm != 0) & (pm != 1)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise StsFileError(
            f"{f}: 'prefix_mask' row {row} position {col} is {pm[row, col]}; "
            f"every value must be 0 or 1 ({int(bad.sum())} bad)"
        )
    return lg, pm


def save_sts_shard(
    path: str | os.PathLike[str], conf_logits: np.ndarray, prefix_mask: np.ndarray
) -> None:
    """Write one shard in SGLang's format (float32 tensors), e.g. from the embedded engine."""
    import torch

    torch.save(
        {
            "logits": torch.as_tensor(np.asarray(conf_logits), dtype=torch.float32),
            "prefix_mask": torch.as_tensor(np.asarray(prefix_mask), dtype=torch.float32),
        },
        str(path),
    )


def sts_data_from_req_steps(
    req_steps: FrameLike, runs: FrameLike | Mapping[str, str] | None = None, mode: str | None = None
) -> StsData:
    """Logits from stored confidences (z = logit(c), c rounded to 4 decimals), censored labels.

    If the run served with an STS file, stored confidences are already calibrated and the
    temperatures fitted here compose with the served ones (T_new * T_served). Rows lacking a
    full confidence vector are dropped; all rows must share one gamma.
    """
    wl = wide_labels(req_steps, runs, mode)
    df = wl.frame
    if len(df) and len(np.unique(wl.gamma)) > 1:
        raise ValueError(
            f"req_steps mix gammas {sorted(set(wl.gamma.tolist()))}; fit one gamma at a time"
        )
    keep = ~np.isnan(np.where(wl.valid, wl.conf, 0.0)).any(axis=1)
    return StsData(
        logit(wl.conf[keep]),
        np.nan_to_num(wl.label[keep], nan=0.0),
        wl.observed[keep],
        request_keys(df.loc[keep]).astype(str),
        text_column(df.loc[keep], "workload", "unknown"),
    )


# ---------------------------------------------------------------- held-out evaluation


@dataclass
class StsHeldout:
    """A fit on some requests, judged on the others."""

    calibration: StsCalibration
    fit_requests: int
    heldout_requests: int
    ece_before: list[float]  # per position, held-out, T = 1
    ece_after: list[float]  # per position, held-out, fitted T
    pooled_before: float
    pooled_after: float
    by_workload: pd.DataFrame  # workload, requests, samples, ece_before, ece_after (held-out)
    after_ci: tuple[float, float] = (float("nan"), float("nan"))
    """Bootstrap interval (over held-out requests) of ``pooled_after``."""
    change_ci: tuple[float, float] = (float("nan"), float("nan"))
    """Bootstrap interval of ``pooled_after - pooled_before`` (same resamples)."""

    @property
    def few_heldout(self) -> bool:
        """Too few held-out requests for the ECE comparison to mean much."""
        return self.heldout_requests < MIN_HELDOUT_REQUESTS

    @property
    def worse(self) -> bool:
        """ECE after STS is higher than before on the held-out requests."""
        return bool(self.pooled_after > self.pooled_before)

    def verdict(self) -> StsVerdict:
        """ok | too few to trust | worse: do not serve (:func:`sts_verdict`)."""
        return sts_verdict(
            self.pooled_before,
            self.pooled_after,
            self.heldout_requests,
            fit_requests=self.fit_requests,
            after_ci=self.after_ci,
            change_ci=self.change_ci,
        )

    def caveats(self) -> list[str]:
        """Plain-language flags a reader must see next to the numbers (empty when none)."""
        return self.verdict().reasons


def split_requests(keys: np.ndarray, heldout_frac: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out rows: whole requests go to one side (seeded permutation)."""
    uniq = np.unique(np.asarray(keys, dtype=str))
    rng = np.random.default_rng(seed)
    perm = rng.permutation(uniq.size)
    n_held = int(round(heldout_frac * uniq.size))
    if uniq.size >= 2:
        n_held = min(max(n_held, 1), uniq.size - 1)
    held = set(uniq[perm[:n_held]].tolist())
    return np.array([k in held for k in np.asarray(keys, dtype=str)], dtype=bool)


def _request_bins(
    test: StsData, temperatures: Sequence[float] | None, inverse: np.ndarray, n: int, n_bins: int
) -> np.ndarray:
    """Per request, the ECE bin sums (count, pred sum, label sum): [3, n_requests, n_bins]."""
    from dspark_obs.analytics.calibration import bin_index, clamp_probs

    t = np.ones(test.gamma) if temperatures is None else np.asarray(temperatures, np.float64)
    s = survival(apply_sts(test.logits, t))
    obs = np.asarray(test.observed, dtype=bool)
    p = clamp_probs(s[obs])
    y = np.asarray(test.prefix_mask, dtype=np.float64)[obs]
    req = np.broadcast_to(inverse[:, None], obs.shape)[obs]
    cell = req * n_bins + bin_index(p, n_bins)
    size = n * n_bins
    return np.stack(
        [
            np.bincount(cell, minlength=size).astype(np.float64),
            np.bincount(cell, weights=p, minlength=size),
            np.bincount(cell, weights=y, minlength=size),
        ]
    ).reshape(3, n, n_bins)


def _heldout_intervals(
    test: StsData, temperatures: Sequence[float], n_bins: int, n_boot: int, seed: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Percentile intervals of ECE after, and of after - before, resampling whole requests.

    Each request's bin sums are computed once; a resample is a weighted sum of them, so the
    bootstrap costs one matrix product instead of ``n_boot`` ECE passes.
    """
    from dspark_obs.analytics._frames import bootstrap_weights, quantile_interval
    from dspark_obs.analytics.calibration import _ece_from_bins

    nan = (float("nan"), float("nan"))
    if test.request is None or len(test.logits) == 0 or n_boot < 1:
        return nan, nan
    keys, inverse = np.unique(np.asarray(test.request, dtype=str), return_inverse=True)
    w = bootstrap_weights(keys.size, n_boot, seed)  # [n_boot, n_requests]
    after = _ece_from_bins(
        *np.einsum("br,krm->kbm", w, _request_bins(test, temperatures, inverse, keys.size, n_bins))
    )
    before = _ece_from_bins(
        *np.einsum("br,krm->kbm", w, _request_bins(test, None, inverse, keys.size, n_bins))
    )
    return quantile_interval(after, 0.95), quantile_interval(after - before, 0.95)


def fit_sts_heldout(
    data: StsData,
    heldout_frac: float = 0.3,
    seed: int = 0,
    n_bins: int = N_BINS,
    n_boot: int = 200,
) -> StsHeldout:
    """Fit on a request split, report ECE before/after on held-out requests only, with
    bootstrap intervals over the held-out requests (``n_boot`` resamples)."""
    if data.request is None:
        raise ValueError("a request split needs StsData.request")
    held = split_requests(data.request, heldout_frac, seed)
    fit_part, test = data.subset(~held), data.subset(held)
    if len(fit_part.logits) == 0:
        raise ValueError("no request left to fit on")
    cal = fit_sts(fit_part.logits, fit_part.prefix_mask, fit_part.observed, n_bins=n_bins)
    after_ci, change_ci = _heldout_intervals(test, cal.temperatures, n_bins, n_boot, seed)
    rows = []
    if test.workload is not None:
        for wk in sorted(set(test.workload.tolist())):
            sel = test.workload == wk
            part = test.subset(sel)
            rows.append(
                {
                    "workload": wk,
                    "requests": int(np.unique(part.request).size)
                    if part.request is not None
                    else 0,
                    "samples": int(part.observed.sum()),
                    "ece_before": pooled_ece(
                        part.logits, part.prefix_mask, None, part.observed, n_bins
                    ),
                    "ece_after": pooled_ece(
                        part.logits, part.prefix_mask, cal.temperatures, part.observed, n_bins
                    ),
                }
            )
    return StsHeldout(
        calibration=cal,
        fit_requests=int(np.unique(fit_part.request).size),
        heldout_requests=int(np.unique(test.request).size) if test.request is not None else 0,
        ece_before=position_ece(
            test.logits, test.prefix_mask, None, test.observed, n_bins
        ).tolist(),
        ece_after=position_ece(
            test.logits, test.prefix_mask, cal.temperatures, test.observed, n_bins
        ).tolist(),
        pooled_before=pooled_ece(test.logits, test.prefix_mask, None, test.observed, n_bins),
        pooled_after=pooled_ece(
            test.logits, test.prefix_mask, cal.temperatures, test.observed, n_bins
        ),
        by_workload=pd.DataFrame(
            rows, columns=["workload", "requests", "samples", "ece_before", "ece_after"]
        ),
        after_ci=after_ci,
        change_ci=change_ci,
    )
