"""SGLang's speculative-decoding accounting, as the engine server reports it: per-request
``meta_info`` spec fields (:class:`SpecCounts`, :func:`spec_meta`) and the ``sglang:*`` gauges
of /metrics (means over each decode-log interval) with the verify-call counter
(:class:`SpecMetrics`). Both are computed from req-step rows, in SGLang's definitions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

__all__ = ["SpecCounts", "SpecMetrics", "spec_meta"]


def _bump(hist: list[int], index: int) -> None:
    if len(hist) <= index:
        hist.extend([0] * (index + 1 - len(hist)))
    hist[index] += 1


@dataclass
class SpecCounts:
    """Per-request speculative counters, as SGLang's scheduler keeps them."""

    verify_ct: int = 0
    correct: int = 0
    cap_tokens: int = 0
    block_tokens: int = 0
    correct_hist: list[int] = field(default_factory=list)
    cap_hist: list[int] = field(default_factory=list)

    def count(self, row: Mapping[str, Any], mode: str) -> None:
        """One verify step of this request (a req-step row)."""
        self.verify_ct += 1
        self.correct += int(row["correct_drafts"])
        _bump(self.correct_hist, int(row["correct_drafts"]))
        self.block_tokens += int(row["acc_len"]) + int(row["cap_trim"])
        if mode != "static":  # SGLang reports cap lengths only when a ragged layout was planned
            self.cap_tokens += int(row["verify_len"])
            _bump(self.cap_hist, int(row["verify_len"]))


def spec_meta(spec: SpecCounts, completion_tokens: int, gamma: int, mode: str) -> dict[str, Any]:
    """SGLang's per-request spec fields of meta_info (none before the first verify)."""
    if spec.verify_ct == 0:
        return {}
    proposed = spec.verify_ct * gamma
    out: dict[str, Any] = {
        "spec_accept_rate": spec.correct / proposed,
        "spec_accept_length": completion_tokens / spec.verify_ct,
        "spec_num_correct_drafts": spec.correct,
        "spec_num_proposed_drafts": proposed,
        "spec_verify_ct": spec.verify_ct,
    }
    if spec.cap_tokens > 0:
        out["spec_cap_length"] = spec.cap_tokens / spec.verify_ct
    if mode == "cap-accept":
        out["spec_block_accept_length"] = spec.block_tokens / spec.verify_ct
    if spec.correct_hist:
        out["spec_correct_drafts_histogram"] = list(spec.correct_hist)
    if spec.cap_hist:
        out["spec_cap_lens_histogram"] = list(spec.cap_hist)
    return out


class SpecMetrics:
    """SGLang's spec gauges (means over each log interval) and verify-call counter."""

    def __init__(
        self, model_name: str, dp_rank: int, mode: str, gamma: int, log_interval: int
    ) -> None:
        self.registry = CollectorRegistry()
        labels = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "dp_rank": str(dp_rank),
        }
        names = list(labels)
        self.interval = max(1, int(log_interval))
        self.mode = mode
        self.gamma = gamma

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**labels)

        self.accept_length = gauge("sglang:spec_accept_length", "Mean accept length per verify.")
        self.accept_rate = gauge("sglang:spec_accept_rate", "Accepted / proposed drafts.")
        self.cap_length = gauge("sglang:spec_cap_length", "Mean scheduled window incl. bonus.")
        self.block_length = gauge(
            "sglang:spec_block_accept_length", "Mean uncapped accept length (cap-accept)."
        )
        self.num_steps = gauge("sglang:spec_num_steps", "Active speculative_num_steps.")
        self.num_draft = gauge("sglang:spec_num_draft_tokens", "Active num_draft_tokens.")
        self.running = gauge("sglang:num_running_reqs", "Running requests.")
        self.verify_calls = counter("sglang:spec_verify_calls", "Speculative verify calls.")
        self.gen_tokens = counter("sglang:generation_tokens", "Generated tokens.")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prefill tokens.")
        self.num_steps.set(self.gamma)
        self.num_draft.set(self.gamma + 1)
        self._reset()

    def _reset(self) -> None:
        self._steps = self._rows = self._accept = self._correct = self._cap = self._block = 0

    def step(self, step: Mapping[str, Any], reqs: Sequence[Mapping[str, Any]]) -> None:
        """One decode step and its req-step rows; the gauges move once per interval."""
        self._steps += 1
        self._rows += len(reqs)
        for r in reqs:
            self._accept += int(r["acc_len"])
            self._correct += int(r["correct_drafts"])
            self._block += int(r["acc_len"]) + int(r["cap_trim"])
            if self.mode != "static":
                self._cap += int(r["verify_len"])
        self.running.set(int(step["bs"]))
        if self._steps >= self.interval and self._rows:
            self.accept_length.set(self._accept / self._rows)
            self.accept_rate.set(self._correct / (self._rows * self.gamma))
            self.cap_length.set(self._cap / self._rows)
            self.block_length.set(self._block / self._rows if self.mode == "cap-accept" else 0)
            self._reset()

    def finished(self, verify_ct: int, completion: int, prompt: int) -> None:
        if verify_ct > 0:
            self.verify_calls.inc(verify_ct)
        self.gen_tokens.inc(completion)
        self.prompt_tokens.inc(prompt)
