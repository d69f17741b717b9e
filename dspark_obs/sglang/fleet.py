"""Fleets: ``collect --targets FILE`` (Prometheus ``file_sd`` format) and the collector's own
per-target metrics.

The file is what Prometheus' ``file_sd_configs`` reads, JSON or YAML: a list of groups
``{"targets": ["host:port", ...], "labels": {...}}``. Every target is one server and one run
(run id ``<prefix>-<host>-<port>``, or the ``dspark_run`` label). A cap-accept companion is
paired by labels: give both groups the same ``dspark_pair`` value and the companion's group
``dspark_role: cap-accept``; its run names the compact run it shadows. Other labels (cluster,
model, ...) are kept in the runs row's config and label the collector's per-target series
(never the run id: see :func:`series_labels`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CollectorMetrics", "FleetTarget", "TargetsError", "read_targets", "series_labels"]

ROLE_LABEL = "dspark_role"  # "compact" (default) | "cap-accept"
PAIR_LABEL = "dspark_pair"  # the same value on a server and its companion
RUN_LABEL = "dspark_run"  # explicit run id (optional)


class TargetsError(ValueError):
    """A targets file that cannot be used (named problem, nothing started)."""


@dataclass(frozen=True)
class FleetTarget:
    url: str
    run_id: str
    labels: dict[str, str] = field(default_factory=dict)
    companion_of: str | None = None


def read_targets(path: Path, run_prefix: str = "sglang") -> list[FleetTarget]:
    """The servers of a file_sd JSON/YAML file, companions paired (see the module doc)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise TargetsError(f"{path}: {exc}") from None
    try:
        groups: Any = json.loads(text)
    except ValueError:
        try:
            import yaml

            groups = yaml.safe_load(text)
        except Exception as exc:  # yaml.YAMLError and friends
            raise TargetsError(f"{path}: neither JSON nor YAML: {exc}") from None
    if not isinstance(groups, list):
        raise TargetsError(f"{path}: expected a list of {{targets, labels}} groups")
    out: list[FleetTarget] = []
    seen: dict[str, str] = {}
    for gi, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("targets"), list):
            raise TargetsError(f"{path}: group {gi}: needs a 'targets' list")
        labels = group.get("labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise TargetsError(f"{path}: group {gi}: 'labels' must map names to strings")
        bad = [k for k in labels if not isinstance(k, str) or not LABEL_NAME.fullmatch(k)]
        if bad:
            raise TargetsError(
                f"{path}: group {gi}: label names {bad!r} are not Prometheus label names "
                "([a-zA-Z_][a-zA-Z0-9_]*)"
            )
        role = labels.get(ROLE_LABEL, "compact")
        if role not in ("compact", "cap-accept"):
            raise TargetsError(
                f"{path}: group {gi}: {ROLE_LABEL}={role!r}; expected compact or cap-accept"
            )
        for ti, addr in enumerate(group["targets"]):
            if not isinstance(addr, str) or not addr.strip():
                raise TargetsError(f"{path}: group {gi} target {ti}: expected 'host:port'")
            url = addr if "://" in addr else f"http://{addr}"
            if url in seen:
                raise TargetsError(f"{path}: {addr} listed twice (groups {seen[url]} and {gi})")
            seen[url] = str(gi)
            host_port = url.split("://", 1)[1].rstrip("/").replace(":", "-").replace("/", "-")
            run = labels.get(RUN_LABEL) if len(group["targets"]) == 1 else None
            out.append(FleetTarget(url, run or f"{run_prefix}-{host_port}", dict(labels)))
    return _pair(out, path)


def _pair(targets: list[FleetTarget], path: Path) -> list[FleetTarget]:
    compact = {
        t.labels[PAIR_LABEL]: t
        for t in targets
        if PAIR_LABEL in t.labels and t.labels.get(ROLE_LABEL, "compact") == "compact"
    }
    out = []
    for t in targets:
        if t.labels.get(ROLE_LABEL) == "cap-accept" and PAIR_LABEL in t.labels:
            main = compact.get(t.labels[PAIR_LABEL])
            if main is None:
                raise TargetsError(
                    f"{path}: {t.url}: no compact server with "
                    f"{PAIR_LABEL}={t.labels[PAIR_LABEL]!r} to shadow"
                )
            t = FleetTarget(t.url, f"{main.run_id}-cap", t.labels, companion_of=main.run_id)
        out.append(t)
    runs = [t.run_id for t in out]
    dup = {r for r in runs if runs.count(r) > 1}
    if dup:
        raise TargetsError(f"{path}: run ids used twice: {sorted(dup)}")
    return out


LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def series_labels(servers: Sequence[Any]) -> tuple[list[str], list[list[str]]]:
    """Label names and, per server, values of the collector's per-target series.

    Only bounded labels: ``target`` (the URL polled), ``role`` (compact or cap-accept) and the
    targets file's own labels (cluster, model, ...; every name any target has, "" where one
    lacks it). Never the run id: a new run per restart of ``collect`` would mint new series
    without end. ``dspark_*`` labels steer the collector and are left out; ``__*`` names are
    Prometheus-internal.
    """
    extra = sorted(
        {
            name
            for sc in servers
            for name in getattr(sc.opts, "labels", {})
            if not name.startswith(("dspark_", "__")) and name not in ("target", "role")
        }
    )
    values = []
    for sc in servers:
        labels = getattr(sc.opts, "labels", {})
        companion = getattr(sc.opts, "companion_of", None)
        role = labels.get(ROLE_LABEL) or ("cap-accept" if companion else "compact")
        values.append([sc.opts.url, role, *(labels.get(name, "") for name in extra)])
    return ["target", "role", *extra], values


class CollectorMetrics:
    """A prometheus_client collector over a Collector: per target ``up``, polls, poll
    failures, stored steps, restarts, lost ranges and lost forward_cts (counters).

    Every target the collector knows is exposed from the first scrape on, its counters at 0,
    so ``increase()`` sees the first failure or lost range instead of a series born at 1.
    """

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels, values = series_labels(self.collector.servers)
        up = GaugeMetricFamily(
            "dspark_collect_target_up", "1 if the last poll of this target succeeded", labels=labels
        )
        fams = {
            "polls": CounterMetricFamily("dspark_collect_polls", "Successful polls", labels=labels),
            "failed_polls": CounterMetricFamily(
                "dspark_collect_poll_failures", "Failed polls", labels=labels
            ),
            "steps": CounterMetricFamily(
                "dspark_collect_stored_steps", "Step rows newly stored", labels=labels
            ),
            "restarts": CounterMetricFamily(
                "dspark_collect_restarts", "Server restarts detected", labels=labels
            ),
            "lost_ranges": CounterMetricFamily(
                "dspark_collect_lost_ranges", "forward_ct ranges lost", labels=labels
            ),
            "lost_forward_cts": CounterMetricFamily(
                "dspark_collect_lost_forward_cts", "forward_ct values in lost ranges", labels=labels
            ),
        }
        for sc, key in zip(self.collector.servers, values, strict=True):
            up.add_metric(key, 1.0 if self.collector.up.get(sc.opts.run_id) else 0.0)
            for name, fam in fams.items():
                fam.add_metric(key, float(getattr(sc.totals, name)))
        yield up
        yield from fams.values()

    def describe(self) -> Sequence[Any]:
        return list(self.collect())
