"""The drafter's transformer layer, built on the target's RMSNorm and rotary embedding.

The norm and rope maths are :mod:`dspark_obs.engine.model`'s (``rms_norm``,
``rope_cos_sin``, ``apply_rope``); what differs is only where the drafter rounds: it keeps
every step in float32 and rounds once at the end (what its checkpoints were trained with
under bf16 autocast), while the target rounds the normalized input before the weight
multiply, as Hugging Face's Llama does. In float32 the two are bit-identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_obs.engine.drafter_config import DrafterConfig
from dspark_obs.engine.model import RMSNorm, apply_rope, rms_norm, rope_cos_sin


class DrafterNorm(RMSNorm):
    """The target's :class:`RMSNorm`, evaluated in float32 and rounded once to x's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x.float(), self.weight.float(), self.eps).to(x.dtype)


def drafter_rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """The target's rotary embedding of heads-first ``x [B, heads, n, hd]`` at absolute
    positions ``pos [B, n]`` (``[1, n]`` or ``[B, 1, n]`` broadcast), computed in float32."""
    b, heads, n, hd = x.shape
    flat = pos.reshape(pos.shape[0], n).expand(b, n).reshape(-1)
    cos, sin = rope_cos_sin(flat, hd, theta, torch.float32)
    rows = x.float().transpose(1, 2).reshape(b * n, heads, hd)
    out = apply_rope(rows, cos, sin).view(b, n, heads, hd).transpose(1, 2)
    return out.to(x.dtype)


class DraftLayer(nn.Module):
    """Pre-norm Llama block whose keys/values are [projected context ; block]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d, h, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.in_norm = DrafterNorm(d, cfg.rms_eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kvh * hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.post_norm = DrafterNorm(d, cfg.rms_eps)
        self.gate = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def queries(self, hn: Tensor, pos: Tensor) -> Tensor:
        """Roped queries [B, heads, n, hd] of already-normalized inputs hn [B, n, d]."""
        b, n, _ = hn.shape
        q = self.q_proj(hn).view(b, n, self.cfg.num_heads, self.cfg.head_dim).transpose(1, 2)
        return drafter_rope(q, pos, self.cfg.rope_theta)

    def kv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (roped) and values [B, kvh, n, hd] of already-normalized inputs x [B, n, d]."""
        b, n, _ = x.shape
        kvh, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        k = self.k_proj(x).view(b, n, kvh, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, n, kvh, hd).transpose(1, 2)
        return drafter_rope(k, pos, self.cfg.rope_theta), v

    def mlp(self, x: Tensor) -> Tensor:
        """x + the SwiGLU feed-forward of post_norm(x): the layer's second half."""
        hn = self.post_norm(x)
        return x + self.down(F.silu(self.gate(hn)) * self.up(hn))

    def forward(self, x: Tensor, pos: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """x [B, Q, d] block states; ctx_k/v [B, kvh, C, hd]; mask [B, 1, Q, C+Q] bool."""
        cfg = self.cfg
        b, q_len, _ = x.shape
        hn = self.in_norm(x)
        q = self.queries(hn, pos)
        k, v = self.kv(hn, pos)
        k = torch.cat([ctx_k.to(k.dtype), k], 2)
        v = torch.cat([ctx_v.to(v.dtype), v], 2)
        rep = cfg.num_heads // cfg.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, 1)
            v = v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, q_len, -1))
        return self.mlp(x)
