"""The DSpark drafter objective, per block position k (1-based), weighted exp(-(k-1)/decay).

``w_ce * CE(q_k, realized x_k) + w_tv * TV(p_k, q_k) + w_kl * KL(p_k || q_k) + w_conf *
BCE(c_k, 1 - TV(p_k, q_k))`` with the BCE target detached (defaults 0.1 / 0.9 / 0 / 1, the
v2 recipe). TV drives q towards p (what rejection sampling rewards) but its gradient only
sees where q and p differ in sign; the forward KL (distillation against the target's whole
distribution) gives every token a gradient; the small CE term keeps the mode sharp for
greedy; the confidence head learns the analytic acceptance. A drafter with a greedy
confidence head adds ``w_conf * BCE(c^greedy_k, 1[argmax q_k == argmax p_k])``: the event
greedy verification accepts.

``regime`` (per row: 1 for sequences the target wrote greedily, 0 for sampled ones) trains
each head only on its own sampling regime's text: the greedy head on greedy sequences (the
contexts greedy decoding produces), the sampling head on sampled ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def position_weights(gamma: int, gamma_decay: float, device: Any = None) -> Tensor:
    """w_k = exp(-(k-1)/gamma_decay), k = 1..gamma: early drafts matter most (they gate
    every later one)."""
    k = torch.arange(gamma, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma_decay)


def tv_distance(p: Tensor, q: Tensor) -> Tensor:
    """Total-variation distance 0.5 * sum |p - q| over the last dim."""
    return 0.5 * (p - q).abs().sum(-1)


@dataclass
class LossParts:
    """Loss and the per-position diagnostics logged while training."""

    loss: Tensor
    ce: float
    tv: float
    bce: float
    accept_1mtv: list[float]  # mean analytic acceptance 1 - TV per position
    greedy_match: list[float]  # mean 1[argmax q == argmax p] per position
    prefix_match: list[float]  # mean 1[argmax q == argmax p at positions 1..k]
    conf_mean: list[float]
    bce_greedy: float = 0.0  # greedy-head BCE (0 without a greedy head)
    conf_greedy_mean: list[float] = field(default_factory=list)


def drafter_loss(
    logits: Tensor,
    conf_logits: Tensor,
    target_logits: Tensor,
    next_tokens: Tensor,
    valid: Tensor,
    gamma_decay: float,
    w_ce: float = 0.1,
    w_tv: float = 0.9,
    w_conf: float = 1.0,
    w_kl: float = 0.0,
    regime: Tensor | None = None,
) -> LossParts:
    """DSpark objective over rows [..., gamma] (logits [..., gamma, V]).

    target_logits are the target's logits for the same predicted positions; next_tokens the
    realized tokens; valid masks positions past the end of a sequence. conf_logits are
    [..., gamma] (sampling head) or [..., gamma, 2] (sampling head, greedy head).
    """
    gamma = logits.shape[-2]
    lq = torch.log_softmax(logits.float(), -1)
    q = lq.exp()
    p = torch.softmax(target_logits.float(), -1)
    tv = tv_distance(p, q)  # [..., gamma]
    ce = -lq.gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1)
    match = (logits.argmax(-1) == target_logits.argmax(-1)).float()
    z = conf_logits.float()
    z_greedy = None
    if z.dim() == logits.dim():
        z, z_greedy = z[..., 0], z[..., 1]
    acc = (1.0 - tv).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(z, acc, reduction="none")
    w = position_weights(gamma, gamma_decay, logits.device) * valid.float()
    denom = w.sum().clamp_min(1e-9)
    per = w_ce * ce + w_tv * tv
    if w_kl:
        kl = (p * (torch.log(p.clamp_min(1e-30)) - lq)).sum(-1)
        per = per + w_kl * kl
    on_sample: Tensor | float = 1.0  # per-row regime masks, or every row
    on_greedy: Tensor | float = 1.0
    if regime is not None and z_greedy is not None:
        g = regime.to(tv.dtype).reshape(-1, *([1] * (tv.dim() - 1))).expand_as(tv)
        on_sample, on_greedy = 1.0 - g, g
    per = per + w_conf * bce * on_sample
    bce_g = None
    if z_greedy is not None:
        bce_g = F.binary_cross_entropy_with_logits(z_greedy, match, reduction="none")
        per = per + w_conf * bce_g * on_greedy
    loss = (per * w).sum() / denom
    with torch.no_grad():
        vf = valid.float().reshape(-1, gamma)
        n = vf.sum(0).clamp_min(1.0)

        def pos_mean(x: Tensor) -> list[float]:
            return ((x.reshape(-1, gamma).float() * vf).sum(0) / n).tolist()

        parts = LossParts(
            loss=loss,
            ce=float((ce * w).sum() / denom),
            tv=float((tv * w).sum() / denom),
            bce=float((bce * w).sum() / denom),
            accept_1mtv=pos_mean(1.0 - tv),
            greedy_match=pos_mean(match),
            prefix_match=pos_mean(match.reshape(-1, gamma).cumprod(-1)),
            conf_mean=pos_mean(torch.sigmoid(z)),
        )
        if z_greedy is not None and bce_g is not None:
            parts.bce_greedy = float((bce_g * w).sum() / denom)
            parts.conf_greedy_mean = pos_mean(torch.sigmoid(z_greedy))
    return parts
