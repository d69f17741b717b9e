"""Which CUDA graphs a decode step can replay, and inputs to capture each one with.

Apart from :mod:`dspark_obs.engine.batched` because it is the plan, not the runtime: the
graph keys follow from the tiers alone (a step pads its batch, its packed tokens and its key
span up to a tier), and a capture needs inputs of a key's shapes that write nothing a request
owns. :meth:`BatchedRuntime.capture` takes every key at start-up, so no step captures.

Keys, per bank (the runtime's graph banks):

* ``verify``: ``(q, batch tier, token tier, span, gather)`` -- a packed forward of up to ``q``
  tokens per row (:meth:`BatchedRuntime.forward`);
* ``block``: ``(q, batch tier, token tier, span)`` -- a whole-block verify with its windows
  and greedy acceptance (:meth:`BatchedRuntime.verify_block`); a ``compact`` step whose budget
  trims packs fewer tokens, so with ``trims`` every token tier up to the block's is a key;
* ``sampled``: ``(q, batch tier, token tier, span, filters)`` -- a whole-block verify with
  sampled rows (rejection sampling in the replay; ``filters``: top-k 2 + top-p 1, the filters
  a row uses). Not taken at
  start-up: the first step of each key with a sampled row captures it;
* ``rest``: ``(q, batch tier, token tier, span)`` -- cap-accept's second forward, the drafts
  past the windows (:meth:`BatchedRuntime.verify_block`'s ``rest``);
* ``draft``: ``(batch tier, gamma, span)`` -- the drafter's block pass and greedy chain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dspark_obs.engine.block_verify import summary_width
from dspark_obs.engine.slots import tier_of

__all__ = ["decode_graph_keys", "dummy_inputs"]


def decode_graph_keys(
    gamma: int,
    spans: Sequence[int],
    batch_tiers: Sequence[int],
    token_tiers: Sequence[int],
    *,
    drafting: bool,
    trims: bool = False,
    rest: bool = False,
) -> list[tuple[str, tuple]]:
    """Every ``(bank, key)`` a decode step of ``gamma`` drafts can replay at these key spans
    and batch tiers (ascending; those the pool holds): for each batch tier the verify token
    tiers above the tier below it, the block tiers its batch sizes pad to (``trims``: also
    those of every trimmed budget, ``b + budget`` tokens for ``b`` requests), (``rest``) the
    tiers of every count of drafts past the windows, and (``drafting``) its draft graph."""
    q = gamma + 1
    keys: list[tuple[str, tuple]] = []
    low = 0
    for bt in batch_tiers:
        for nt in (t for t in token_tiers if low < t <= bt * q):
            keys += [("verify", (q, bt, nt, span, False)) for span in spans]
        counts = range(low + 1, bt * q + 1) if trims else range((low + 1) * q, bt * q + 1, q)
        for nt in sorted({tier_of(n, token_tiers) for n in counts}):
            keys += [("block", (q, bt, nt, span)) for span in spans]
        if rest:
            past = range(1, bt * gamma + 1)
            for nt in sorted({tier_of(n, token_tiers) for n in past}):
                keys += [("rest", (q, bt, nt, span)) for span in spans]
        if drafting:
            keys += [("draft", (bt, gamma, span)) for span in spans]
        low = bt
    return keys


def dummy_inputs(bank: str, key: tuple, device: torch.device, trash: int) -> dict[str, Tensor]:
    """Inputs of a graph's shapes that touch only the scratch slot ``trash`` (no request's
    cache): every row writes there, every length is 0."""
    dev = device
    if bank == "draft":
        bt, gamma, span = key
        return {
            "anchors": torch.zeros(bt, dtype=torch.long, device=dev),
            "committed": torch.zeros(bt, dtype=torch.long, device=dev),
            "sts": torch.ones(bt, gamma, device=dev),
            "span": torch.empty(span, device=dev),
        }
    if bank == "block":
        q, bt, nt, span = key
        return {
            "drafts": torch.zeros(bt, q - 1, dtype=torch.long, device=dev),
            "conf": torch.ones(bt, q - 1, device=dev),
            "logprobs": torch.zeros(bt, q - 1, device=dev),
            "start": torch.zeros(bt, dtype=torch.long, device=dev),
            "anchors": torch.zeros(bt, dtype=torch.long, device=dev),
            "plan": torch.tensor([0.0, 0.0, -1.0, 0.0], device=dev),  # no live row: all padding
            "rows": torch.empty(nt, device=dev),
            "q": torch.empty(q, device=dev),
            "span": torch.empty(span, device=dev),
        }
    if bank == "rest":
        q, bt, nt, span = key
        return {
            "drafts": torch.zeros(bt, q - 1, dtype=torch.long, device=dev),
            "start": torch.zeros(bt, dtype=torch.long, device=dev),
            "anchors": torch.zeros(bt, dtype=torch.long, device=dev),
            "summary": torch.zeros(bt, summary_width(q - 1), device=dev),  # windows 0: padding
            "rows": torch.empty(nt, device=dev),
            "q": torch.empty(q, device=dev),
            "span": torch.empty(span, device=dev),
        }
    q, bt, nt, span, _ = key
    return {
        "tokens": torch.zeros(nt, dtype=torch.long, device=dev),
        "slot": torch.full((nt,), trash, dtype=torch.long, device=dev),
        "pos": torch.zeros(nt, dtype=torch.long, device=dev),
        "qidx": torch.full((nt,), bt * q, dtype=torch.long, device=dev),
        "past": torch.zeros(bt, dtype=torch.long, device=dev),
        "q": torch.empty(q, device=dev),
        "span": torch.empty(span, device=dev),
    }
