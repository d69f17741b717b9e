"""Tiny random-initialized targets and drafters of the real architecture, for tests and benches.

Why one builder: the engine, sink, profile and server tests each need "a small random target
and a drafter sharing its layout", differing only in vocabulary, precision, drafter depth and
how far the drafter is pushed from its init. Seeding and construction order live here once, so
the same arguments always give the same weights.
"""

from __future__ import annotations

from typing import Any

import torch

from dspark_obs.cost_table import AdditiveCostTable
from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.drafter_config import DrafterConfig
from dspark_obs.engine.model import ModelConfig, Target
from dspark_obs.engine.session import Models

BYTE_VOCAB = 128  # the engine server's ByteCodec: one token per ASCII character

__all__ = ["BYTE_VOCAB", "byte_models", "tiny_models", "tiny_pair"]


def tiny_pair(
    seed: int = 0,
    *,
    vocab_size: int = 6,
    max_position: int = 512,
    double: bool = True,
    num_layers: int = 1,
    markov_rank: int | None = 4,
    gamma_max: int = 5,
    context_window: int | None = 64,
    perturb: float = 0.0,
) -> tuple[Target, Drafter]:
    """A tiny random target and a drafter derived from it, in eval mode.

    ``markov_rank`` / ``context_window`` of None keep :class:`DrafterConfig`'s defaults;
    ``perturb`` > 0 redraws every drafter weight from N(0, perturb), so drafts and confidences
    vary instead of sitting near the init. A small vocabulary (the default 6) makes random
    drafts often accepted, so windows get trimmed.
    """
    torch.manual_seed(seed)
    # the target is cast before the drafter is built from it, as every caller did before
    target = Target(ModelConfig.tiny(vocab_size=vocab_size, max_position=max_position))
    target = (target.double() if double else target).eval()
    overrides: dict[str, Any] = {"num_layers": num_layers, "gamma_max": gamma_max}
    if markov_rank is not None:
        overrides["markov_rank"] = markov_rank
    if context_window is not None:
        overrides["context_window"] = context_window
    drafter = Drafter(DrafterConfig.for_target(target, **overrides), target)
    drafter = (drafter.double() if double else drafter).eval()
    if perturb > 0.0:
        with torch.no_grad():
            for p in drafter.parameters():
                p.normal_(0.0, perturb)
    return target, drafter


def tiny_models(
    seed: int = 0, *, model_name: str = "tiny", drafter_name: str = "tiny-drafter", **kw: Any
) -> Models:
    """:func:`tiny_pair` wrapped as :class:`Models` (no tokenizer, no stop ids); float32
    unless ``double=True`` is passed."""
    kw.setdefault("double", False)
    target, drafter = tiny_pair(seed, **kw)
    return Models(target, drafter, None, (), model_name, drafter_name)


def byte_models(seed: int = 0, gamma_max: int = 5) -> Models:
    """The tiny models ``dspark-obs engine-server --tiny`` serves: the byte vocabulary, so a
    random model can answer text requests through the ByteCodec."""
    return tiny_models(
        seed,
        vocab_size=BYTE_VOCAB,
        max_position=1024,
        gamma_max=gamma_max,
        model_name="tiny-random",
        drafter_name="tiny-random-drafter",
    )


def trimming_table() -> AdditiveCostTable:
    """A cost table whose verify tokens cost a little: confident batches verify everything,
    others trim (so compact's windows, censored blocks and the estimator's work all run)."""
    return AdditiveCostTable.from_dict({
        "bias_seconds": 0.01, "bs_probes": [1, 16], "alpha_seconds": [0.0, 0.0],
        "m_probes": [1, 8, 16, 64, 128], "theta_seconds": [0.0, 0.002, 0.005, 0.03, 0.08],
    })  # fmt: skip
