"""Packed forwards over a slot pool: the target and the drafter, one attention call per layer.

Pure functions of tensors (no host syncs, fixed shapes per call), so a CUDA graph can capture
them: :mod:`dspark_obs.engine.batched` owns the pool, the index arrays and the graphs.

* :func:`target_forward` runs every request's new tokens packed as ``[N, d]`` through the
  dense layers and ONE scaled-dot-product attention per layer: queries are scattered into a
  ``[B, Q]`` grid (row b = slot b, or the slot ``row_slot[b]`` for a prefill of a few
  requests) against the pool's K/V, masked by position. It writes the new K/V into the pool.
* :func:`drafter_extend` writes the drafter's context K/V of verified rows (target features
  projected once) into the drafter pool.
* :func:`draft_block` runs the drafter's block pass and greedy chain for slots ``0..B-1``:
  its block K/V go into the drafter pool as scratch, so one attention covers context and
  block.

Under ``compiled`` each target layer (:func:`_layer`) and each drafter layer of the block
pass (:func:`_draft_layer`) is one ``torch.compile`` function, its pool planes arguments, and
so are the block's draft head and greedy chain (:func:`_draft_head`).

Every number comes from the reference modules (norms, projections, rotary tables): only the
layout differs, and the tests hold both paths to 1e-9 in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dspark_obs.engine.drafter import ChainWeights, Drafter, greedy_chain
from dspark_obs.engine.drafter_layers import DraftLayer
from dspark_obs.engine.model import Target, apply_rope, rms_norm, rope_cos_sin

__all__ = ["draft_block", "drafter_extend", "target_forward"]


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


def _layer(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
    slot: Tensor,
    pos: Tensor,
    qidx: Tensor,
    gidx: Tensor,
    keys: Tensor,
    values: Tensor,
    row_slot: Tensor | None,
    attn_norm: Tensor,
    wqkv: Tensor,
    wo: Tensor,
    mlp_norm: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    heads: int,
    eps: float,
) -> Tensor:
    """One decoder layer of packed tokens x [N, d] over the pool: norm, fused q/k/v, rotary,
    this forward's K/V into ``keys``/``values`` (the layer's pool planes [slots, kvh, L, hd]),
    queries scattered to the [B, Q] grid (``qidx``), one attention, the grid read back per
    token (``gidx``), output projection and SwiGLU MLP.

    Why one function: compiled, it is one fusion region per layer (the rotary embedding, the
    K/V scatter and the grid scatter become one kernel, the output gather feeds the
    projection), where the same maths as separate calls launched about twice the kernels.
    The planes come in as arguments because compiled code writes an argument in place but
    turns a write through a view it takes itself (``kv[li, 0][slot, :, pos] = k``) into a
    copy of the whole pool and a copy back (the drafter's writes compiled that way cost 1.3 ms
    per step at batch 64 on an H200).
    """
    batch, span = mask.shape[0], mask.shape[-1]
    kv_heads, hd = keys.shape[1], keys.shape[-1]
    group = heads // kv_heads
    q = mask.shape[2] // group
    qq, k, v = F.linear(rms_norm(x, attn_norm, eps), wqkv).split(
        (heads * hd, kv_heads * hd, kv_heads * hd), dim=-1
    )
    keys[slot, :, pos] = apply_rope(k.reshape(-1, kv_heads, hd), cos, sin)
    values[slot, :, pos] = v.reshape(-1, kv_heads, hd)
    qq = apply_rope(qq.reshape(-1, heads, hd), cos, sin)
    grid = qq.new_zeros(batch * q + 1, heads, hd).index_copy(0, qidx, qq)
    if row_slot is None:
        k_read, v_read = keys[:batch, :, :span], values[:batch, :, :span]
    else:
        k_read, v_read = keys[row_slot, :, :span], values[row_slot, :, :span]
    o = _attend(grid[: batch * q].view(batch, q, heads, hd), k_read, v_read, mask, kv_heads, group)
    x = x + F.linear(o.reshape(batch * q, -1)[gidx], wo)
    gate, up = F.linear(rms_norm(x, mlp_norm, eps), w_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w_down)


_COMPILED: dict[str, Callable[..., Tensor]] = {}
_GRAPHS_PER_FUNCTION = 64  # specialisations one compiled function may hold (see _maybe_compiled)


def _maybe_compiled(fn: Callable[..., Tensor], compiled: bool) -> Callable[..., Tensor]:
    """``fn`` (a layer function), eager or compiled by ``torch.compile`` (one compilation
    with dynamic sizes serves every layer and every graph tier: weights and pool planes are
    arguments, and a drafter layer's module is one too, whose parameters dynamo takes as
    inputs, so the drafter's layers share one graph).

    Dynamic sizes still specialise where a size is 1 (one token, one row, one query per
    row) and where ``row_slot`` is None: a bounded set of graphs, about a dozen across the
    tiers, above dynamo's default limit of 8 recompilations per function, so the limit is
    raised while this function compiles (and only then).

    Inductor's on-disk caches are off while it compiles: on an H200 (torch 2.11) a process
    that loaded a compiled layer cached by an earlier process with another pool length
    stopped on a size assertion inside it (``runtime/bench/inductor_cache_crash_cuda.log``),
    and every run with the caches off ran clean. It costs each process its compile time."""
    if not compiled:
        return fn
    if fn.__name__ not in _COMPILED:
        done = torch.compile(fn, dynamic=True, fullgraph=True)
        limit = torch._dynamo.config.patch(recompile_limit=_GRAPHS_PER_FUNCTION)
        import torch._inductor.config as inductor  # only a compiling caller pays the import

        no_disk_cache = inductor.patch(force_disable_caches=True)
        _COMPILED[fn.__name__] = no_disk_cache(limit(done))
    return _COMPILED[fn.__name__]


def _additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the additive one attention uses (0 / -inf) in ``dtype``,
    built once per forward: handed a boolean mask, every layer's attention converts it."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return zero.masked_fill(~visible, float("-inf"))


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
    group = cfg.num_heads // cfg.num_kv_heads
    x = target.embed(tokens)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
    mask = _additive_mask(_grid_mask(past, q, span, group), x.dtype)
    gidx = qidx.clamp(max=past.shape[0] * q - 1)  # padding rows read any cell; discarded
    wanted = {int(i): j for j, i in enumerate(hidden_layers)}
    captured: list[Tensor | None] = [None] * len(wanted)
    layer = _maybe_compiled(_layer, compiled)
    for li, block in enumerate(target.layers):
        attn, mlp = block.attn, block.mlp
        x = layer(
            x, cos, sin, mask, slot, pos, qidx, gidx, kv[li, 0], kv[li, 1], row_slot,
            block.attn_norm.weight, attn.wqkv.weight, attn.wo.weight, block.mlp_norm.weight,
            mlp.w_gate_up.weight, mlp.w_down.weight, cfg.num_heads, cfg.rms_norm_eps,
        )  # fmt: skip
        if li in wanted:
            captured[wanted[li]] = x
    feats = torch.cat([c for c in captured if c is not None], -1) if wanted else x[:, :0]
    return target.norm(x), feats


def _context_features(drafter: Drafter, feats: Tensor) -> Tensor:
    """The drafter's context features of packed target features [N, k * d] -> [N, d]."""
    return drafter.project_context(feats)


def _extend_layer(
    layer: DraftLayer, x: Tensor, slot: Tensor, pos: Tensor, keys: Tensor, values: Tensor
) -> None:
    """One drafter layer's context K/V of features x [N, d] into its pool planes (arguments
    for :func:`_layer`'s reason) at ``(slot, pos)``."""
    k, v = layer.kv(x[None], pos[None])  # [1, kvh, N, hd]
    keys[slot, :, pos] = k[0].transpose(0, 1)
    values[slot, :, pos] = v[0].transpose(0, 1)


def drafter_extend(
    drafter: Drafter,
    dkv: Tensor,
    feats: Tensor,
    slot: Tensor,
    pos: Tensor,
    compiled: bool = False,
) -> None:
    """Write the drafter's context K/V of packed rows (target features) into the pool. Under
    ``compiled`` the projection and each layer's write are compiled functions (eagerly they
    are ~15 small kernels per layer, inside every verify graph)."""
    x = _maybe_compiled(_context_features, compiled)(drafter, feats)
    write = _maybe_compiled(_extend_layer, compiled)
    for li, layer in enumerate(drafter._draft_layers()):
        write(layer, x, slot, pos, dkv[li, 0], dkv[li, 1])


def _draft_layer(
    layer: DraftLayer, x: Tensor, pos: Tensor, rows: Tensor, mask: Tensor, keys: Tensor,
    values: Tensor,
) -> Tensor:
    """One drafter layer of block states x [B, g, d] at positions pos [B, g]: its block K/V
    into ``keys``/``values`` (the layer's drafter pool planes) at grid rows ``rows``, one
    attention over the pool's first ``span`` positions (``mask`` [B, 1, 1, span]), the
    output projection and the MLP. The planes are arguments for :func:`_layer`'s reason."""
    cfg = layer.cfg
    batch, g = pos.shape
    n_kv, hd = cfg.num_kv_heads, cfg.head_dim
    span = mask.shape[-1]
    hn = layer.in_norm(x)
    qq = layer.queries(hn, pos).transpose(1, 2)  # [B, g, H, hd]
    k, v = layer.kv(hn, pos)  # [B, kvh, g, hd]
    flat = pos.reshape(-1)
    keys[rows, :, flat] = k.transpose(1, 2).reshape(batch * g, n_kv, hd)
    values[rows, :, flat] = v.transpose(1, 2).reshape(batch * g, n_kv, hd)
    a = _attend(qq, keys[:batch, :, :span], values[:batch, :, :span], mask, n_kv,
                cfg.num_heads // n_kv)  # fmt: skip
    return layer.mlp(x + layer.o_proj(a))


def _draft_head(
    x: Tensor, norm_weight: Tensor, eps: float, anchors: Tensor, sts: Tensor, w: ChainWeights
) -> tuple[Tensor, ...]:
    """The block states' final norm, the draft head and the greedy chain: (drafts, log q,
    confidence logits, confidences, h, base logits in the head's dtype). One function, so
    compiled it fuses the chain's small per-position kernels (the base logits are summed in
    float32 where they are read, never written out in float32)."""
    h = rms_norm(x, norm_weight, eps)
    base = F.linear(h.to(w.head.dtype), w.head)
    return (*greedy_chain(h, base, anchors, sts, w), h, base)


def draft_block(
    drafter: Drafter,
    dkv: Tensor,
    anchors: Tensor,
    committed: Tensor,
    sts: Tensor,
    span: int,
    compiled: bool = False,
) -> tuple[Tensor, ...]:
    """The drafter's block pass and greedy chain for slots ``0..B-1``: (drafts [B, gamma],
    log q, confidence logits, confidences ``sigmoid(z / sts)`` (``sts`` [B, gamma]), h
    [B, gamma, d], base logits [B, gamma, V'] in the head's dtype).

    The block's own K/V go into the pool at positions ``committed .. committed + g - 1``
    (scratch: the next verify overwrites them with committed features), so one attention
    over the pool covers context and block; the mask shows each slot its last
    ``context_window`` committed positions and its block (bidirectional).
    """
    cfg = drafter.cfg
    g = cfg.gamma_max
    batch = anchors.shape[0]
    dev = anchors.device
    pos = committed[:, None] + torch.arange(g, device=dev)  # [B, g]
    kpos = torch.arange(span, device=dev)[None, :]
    c = committed[:, None]
    vis = ((kpos < c) & (kpos >= c - cfg.context_window)) | ((kpos >= c) & (kpos < c + g))
    x = drafter._block_input(anchors, g)
    mask = _additive_mask(vis[:, None, None, :], x.dtype)  # every block query, same keys
    rows = torch.arange(batch, device=dev).repeat_interleave(g)
    layer_fn = _maybe_compiled(_draft_layer, compiled)
    for li, layer in enumerate(drafter._draft_layers()):
        x = layer_fn(layer, x, pos, rows, mask, dkv[li, 0], dkv[li, 1])
    norm = drafter.target.norm
    head = _maybe_compiled(_draft_head, compiled)
    return head(x[:, : sts.shape[1]], norm.weight, norm.eps, anchors, sts,
                drafter.greedy_chain_weights())  # fmt: skip
