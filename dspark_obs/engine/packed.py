"""Packed forwards over a slot pool: the target and the drafter, one attention call per layer.

Pure functions of tensors (no host syncs, fixed shapes per call), so a CUDA graph can capture
them: :mod:`dspark_obs.engine.batched` owns the pool, the index arrays and the graphs.

* :func:`target_forward` runs every request's new tokens packed as ``[N, d]`` through the
  dense layers and ONE scaled-dot-product attention per layer: queries are scattered into a
  ``[B, Q]`` grid (row b = slot b, or the slot ``row_slot[b]`` for a prefill of a few
  requests) against the pool's K/V, masked by position. It writes the new K/V into the pool.
* :func:`drafter_extend` writes the drafter's context K/V of verified rows (target features
  projected once) into the drafter pool.
* :func:`drafter_states` runs the drafter's block pass for slots ``0..B-1``: its block K/V
  go into the drafter pool as scratch, so one attention covers context and block.

Every number comes from the reference modules (norms, projections, rotary tables): only the
layout differs, and the tests hold both paths to 1e-9 in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.drafter_layers import drafter_rope
from dspark_obs.engine.model import Target, apply_rope, rms_norm, rope_cos_sin

__all__ = ["dense_functions", "drafter_extend", "drafter_states", "target_forward"]


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, n_kv: int, group: int) -> Tensor:
    """q [B, Q, heads, hd] grid against k/v [B, kv_heads, L, hd] -> [B, Q, heads * hd].

    Query heads of one K/V head are folded into the query axis ([B, kv, group * Q, hd]) so
    grouped-query attention needs no K/V copy; ``mask`` is [B, 1, group * Q | 1, L].
    """
    b, qn, _, hd = q.shape
    qg = q.view(b, qn, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(b, n_kv, group * qn, hd)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return o.view(b, n_kv, group, qn, hd).permute(0, 3, 1, 2, 4).reshape(b, qn, -1)


def _grid_mask(past: Tensor, q: int, length: int, group: int) -> Tensor:
    """[B, 1, group * q, L]: grid cell (b, j) sees positions <= past[b] + j."""
    qpos = past[:, None] + torch.arange(q, device=past.device)  # [B, q]
    vis = torch.arange(length, device=past.device)[None, None, :] <= qpos[:, :, None]
    b = past.shape[0]
    return vis[:, None, None].expand(b, 1, group, q, length).reshape(b, 1, group * q, length)


def _pre_attention(
    x: Tensor, norm: Tensor, eps: float, wqkv: Tensor, cos: Tensor, sin: Tensor,
    heads: int, kv_heads: int, hd: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Norm, fused q/k/v projection and rotary embedding of a layer's packed tokens."""
    q, k, v = F.linear(rms_norm(x, norm, eps), wqkv).split(
        (heads * hd, kv_heads * hd, kv_heads * hd), dim=-1
    )
    q = apply_rope(q.view(-1, heads, hd), cos, sin)
    return q, apply_rope(k.view(-1, kv_heads, hd), cos, sin), v.view(-1, kv_heads, hd)


def _post_attention(
    x: Tensor, o: Tensor, wo: Tensor, norm: Tensor, eps: float, w_gate_up: Tensor,
    w_down: Tensor,
) -> Tensor:
    """Output projection, residual, norm and SwiGLU MLP of a layer's packed tokens."""
    x = x + F.linear(o, wo)
    gate, up = F.linear(rms_norm(x, norm, eps), w_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w_down)


_DENSE = {"pre": _pre_attention, "post": _post_attention}
_COMPILED: dict[str, Callable[..., object]] = {}


def dense_functions(compiled: bool) -> tuple[Callable[..., object], Callable[..., object]]:
    """The per-layer dense pieces, eager or fused by ``torch.compile`` (one compilation with
    dynamic token counts serves every layer and every graph tier)."""
    if not compiled:
        return _pre_attention, _post_attention
    if not _COMPILED:
        for name, fn in _DENSE.items():
            _COMPILED[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return _COMPILED["pre"], _COMPILED["post"]


def target_forward(
    target: Target,
    kv: Tensor,
    tokens: Tensor,
    slot: Tensor,
    pos: Tensor,
    qidx: Tensor,
    past: Tensor,
    q: int,
    span: int,
    hidden_layers: Sequence[int],
    compiled: bool = False,
    row_slot: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One packed forward, writing new K/V into the pool: (final-normed states [N, d],
    concatenated ``hidden_layers`` outputs [N, k * d]). Attention reads cache positions
    ``[0, span)`` (span covers every slot's end); grid row b reads slot b's cache, or slot
    ``row_slot[b]``'s (gathered) when given. Graph-safe: no host syncs."""
    cfg = target.cfg
    n_kv, hd = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // n_kv
    batch = past.shape[0]
    x = target.embed(tokens)
    cos, sin = rope_cos_sin(pos, hd, cfg.rope_theta, x.dtype)
    mask = _grid_mask(past, q, span, group)
    gidx = qidx.clamp(max=batch * q - 1)  # padding rows read any cell; they are discarded
    grid = x.new_zeros(batch * q + 1, cfg.num_heads, hd)
    wanted = {int(i): j for j, i in enumerate(hidden_layers)}
    captured: list[Tensor | None] = [None] * len(wanted)
    pre, post = dense_functions(compiled)
    eps = cfg.rms_norm_eps
    for li, block in enumerate(target.layers):
        attn, mlp = block.attn, block.mlp
        qq, k, v = pre(  # type: ignore[misc]
            x, block.attn_norm.weight, eps, attn.wqkv.weight, cos, sin, cfg.num_heads, n_kv, hd
        )
        kv[li, 0, slot, :, pos] = k
        kv[li, 1, slot, :, pos] = v
        g = grid.index_copy(0, qidx, qq)[: batch * q].view(batch, q, cfg.num_heads, hd)
        if row_slot is None:
            keys, values = kv[li, 0, :batch, :, :span], kv[li, 1, :batch, :, :span]
        else:
            keys, values = kv[li, 0, row_slot, :, :span], kv[li, 1, row_slot, :, :span]
        o = _attend(g, keys, values, mask, n_kv, group)
        x = post(  # type: ignore[assignment]
            x, o.reshape(batch * q, -1)[gidx], attn.wo.weight, block.mlp_norm.weight, eps,
            mlp.w_gate_up.weight, mlp.w_down.weight,
        )
        if li in wanted:
            captured[wanted[li]] = x
    feats = torch.cat([c for c in captured if c is not None], -1) if wanted else x[:, :0]
    return target.norm(x), feats


def drafter_extend(drafter: Drafter, dkv: Tensor, feats: Tensor, slot: Tensor, pos: Tensor) -> None:
    """Write the drafter's context K/V of packed rows (target features) into the pool."""
    x = drafter.project_context(feats)[None]  # [1, N, d]
    for li, layer in enumerate(drafter._draft_layers()):
        k, v = layer.kv(x, pos[None])  # [1, kvh, N, hd]
        dkv[li, 0, slot, :, pos] = k[0].transpose(0, 1)
        dkv[li, 1, slot, :, pos] = v[0].transpose(0, 1)


def drafter_states(
    drafter: Drafter, dkv: Tensor, anchors: Tensor, committed: Tensor, gamma: int, span: int
) -> tuple[Tensor, Tensor]:
    """The drafter's block pass for slots ``0..B-1``: (h [B, gamma, d], base logits float).

    The block's own K/V go into the pool at positions ``committed .. committed + g - 1``
    (scratch: the next verify overwrites them with committed features), so one attention
    over the pool covers context and block; the mask shows each slot its last
    ``context_window`` committed positions and its block (bidirectional).
    """
    cfg = drafter.cfg
    g = cfg.gamma_max
    batch = anchors.shape[0]
    dev = anchors.device
    n_kv, hd = cfg.num_kv_heads, cfg.head_dim
    group = cfg.num_heads // n_kv
    pos = committed[:, None] + torch.arange(g, device=dev)  # [B, g]
    kpos = torch.arange(span, device=dev)[None, :]
    c = committed[:, None]
    vis = ((kpos < c) & (kpos >= c - cfg.context_window)) | ((kpos >= c) & (kpos < c + g))
    mask = vis[:, None, None, :]  # [B, 1, 1, L]: every block query sees the same keys
    rows = torch.arange(batch, device=dev).repeat_interleave(g)
    flat_pos = pos.reshape(-1)
    x = drafter._block_input(anchors, g)
    for li, layer in enumerate(drafter._draft_layers()):
        hn = layer.in_norm(x)
        qq = layer.q_proj(hn).view(batch, g, cfg.num_heads, hd).transpose(1, 2)
        qq = drafter_rope(qq, pos, cfg.rope_theta).transpose(1, 2)  # [B, g, H, hd]
        k, v = layer.kv(hn, pos)  # [B, kvh, g, hd]
        dkv[li, 0, rows, :, flat_pos] = k.transpose(1, 2).reshape(batch * g, n_kv, hd)
        dkv[li, 1, rows, :, flat_pos] = v.transpose(1, 2).reshape(batch * g, n_kv, hd)
        a = _attend(qq, dkv[li, 0, :batch, :, :span], dkv[li, 1, :batch, :, :span], mask, n_kv,
                    group)
        x = x + layer.o_proj(a)
        hn = layer.post_norm(x)
        x = x + layer.down(F.silu(layer.gate(hn)) * layer.up(hn))
    h = drafter._final_norm(x[:, :gamma])
    return h, drafter.draft_logits(h).float()
