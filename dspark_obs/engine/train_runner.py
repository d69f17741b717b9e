"""The frozen target run padded and batched, for training data (generation, teacher forcing).

The engine's ragged ``Target.forward`` (one attention per request) is right for serving but
slow over hundreds of training rows; here the same modules and weights run on one padded
tensor with one attention call per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_obs.engine.model import ModelConfig, apply_rope, rope_cos_sin


class PaddedRunner:
    """Padded, batched passes over the target's own modules (generation, teacher forcing).

    The engine's ``Target.forward`` is ragged with per-request attention, right for serving
    but slow for data generation over hundreds of rows; here every row shares one padded
    tensor, one SDPA call per layer and a preallocated KV buffer. Same weights, same maths
    (tests check it against ``Target.forward``).
    """

    def __init__(self, target: nn.Module, device: torch.device | str):
        tgt: Any = target
        self.target = tgt
        self.device = torch.device(device)
        self.cfg: ModelConfig = tgt.cfg

    def _qkv(self, blk: Any, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T, hd], k/v [B, kvh, T, hd]; cos/sin [B*T, hd/2] for the rows' positions."""
        cfg = self.cfg
        b, t, _ = x.shape
        hd = cfg.head_dim
        q, k, v = blk.attn.wqkv(blk.attn_norm(x)).split(
            (cfg.hidden_size, cfg.kv_dim, cfg.kv_dim), dim=-1
        )
        q = apply_rope(q.reshape(b * t, cfg.num_heads, hd), cos, sin)
        k = apply_rope(k.reshape(b * t, cfg.num_kv_heads, hd), cos, sin)
        q = q.view(b, t, cfg.num_heads, hd).transpose(1, 2)
        k = k.view(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        v = v.reshape(b, t, cfg.num_kv_heads, hd).transpose(1, 2)
        return q, k, v

    def _rope_table(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos = torch.arange(n, device=self.device)
        return rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def _finish(self, blk: Any, x: Tensor, o: Tensor) -> Tensor:
        b, t = x.shape[:2]
        x = x + blk.attn.wo(o.transpose(1, 2).reshape(b, t, -1))
        return x + blk.mlp(blk.mlp_norm(x))

    def _rep(self, kv: Tensor) -> Tensor:
        """Expand kv heads to query heads (head h uses kv head h // group), so SDPA can pick
        its fused kernels whatever its grouped-query support."""
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        return kv if group == 1 else kv.repeat_interleave(group, 1)

    @torch.no_grad()
    def features(self, tokens: Tensor, layers: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Teacher-forced pass over right-padded tokens [B, T]: hidden states of ``layers``
        concatenated [B, T, L*d] and the final-normed last layer [B, T, d]."""
        tgt = self.target
        b, t = tokens.shape
        x = tgt.embed(tokens)
        cos, sin = self._rope_table(t, x.dtype)
        cos, sin = cos.repeat(b, 1), sin.repeat(b, 1)
        captured: dict[int, Tensor] = {}
        for i, blk in enumerate(tgt.layers):
            q, k, v = self._qkv(blk, x, cos, sin)
            o = F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), is_causal=True)
            x = self._finish(blk, x, o)
            if i in layers:
                captured[i] = x
        hidden = torch.cat([captured[i] for i in layers], -1)
        return hidden, tgt.norm(x)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float,
        generator: torch.Generator,
        eos_ids: Sequence[int],
    ) -> list[list[int]]:
        """Continue every prompt (greedy if temperature <= 0, else sampled) to EOS/limit.

        Left-padded prompts, one KV buffer for the batch; each row's positions start at 0.
        The returned responses include the EOS token when one was produced.
        """
        tgt, cfg, dev = self.target, self.cfg, self.device
        b = len(prompts)
        plen = max(len(p) for p in prompts)
        total = plen + max_new_tokens
        pads = torch.tensor([plen - len(p) for p in prompts], device=dev)
        toks = torch.zeros(b, plen, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            toks[i, plen - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        cols = torch.arange(total, device=dev)
        key_ok = cols[None, :] >= pads[:, None]  # [B, total]
        shape = (b, cfg.num_kv_heads, total, cfg.head_dim)
        kbuf = [torch.zeros(shape, device=dev, dtype=tgt.dtype) for _ in tgt.layers]
        vbuf = [torch.zeros(shape, device=dev, dtype=tgt.dtype) for _ in tgt.layers]
        cos_t, sin_t = self._rope_table(total, tgt.dtype)
        # prefill (pad queries also see themselves so no softmax row is empty)
        pos = (cols[None, :plen] - pads[:, None]).clamp_min(0).reshape(-1)
        causal = cols[None, :plen, None] >= cols[None, None, :plen]
        eye = torch.eye(plen, dtype=torch.bool, device=dev)[None]
        mask = ((causal & key_ok[:, None, :plen]) | eye)[:, None]
        x = tgt.embed(toks)
        for li, blk in enumerate(tgt.layers):
            q, k, v = self._qkv(blk, x, cos_t[pos], sin_t[pos])
            kbuf[li][:, :, :plen] = k
            vbuf[li][:, :, :plen] = v
            o = F.scaled_dot_product_attention(q, self._rep(k), self._rep(v), attn_mask=mask)
            x = self._finish(blk, x, o)
        logits = tgt.lm_head(tgt.norm(x[:, -1])).float()
        out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        n_out = torch.full((b,), max_new_tokens, dtype=torch.long, device=dev)
        eos = torch.tensor(sorted(set(int(e) for e in eos_ids)) or [-1], device=dev)
        group = cfg.num_heads // cfg.num_kv_heads
        scale = cfg.head_dim**-0.5
        for step in range(max_new_tokens):
            nxt = _pick(logits, temperature, generator)
            out[:, step] = nxt
            hit = torch.isin(nxt, eos) & ~done
            n_out = torch.where(hit, torch.full_like(n_out, step + 1), n_out)
            done |= hit
            if step + 1 == max_new_tokens or (step % 16 == 15 and bool(done.all())):
                break
            col = plen + step
            pos = col - pads
            neg = torch.zeros(b, 1, 1, col + 1, device=dev, dtype=torch.float32)
            neg.masked_fill_(~key_ok[:, None, None, : col + 1], float("-inf"))
            x = tgt.embed(nxt[:, None])
            cos, sin = cos_t[pos], sin_t[pos]
            for li, blk in enumerate(tgt.layers):
                q, k, v = self._qkv(blk, x, cos, sin)
                kbuf[li][:, :, col] = k[:, :, 0]
                vbuf[li][:, :, col] = v[:, :, 0]
                # one query per row: grouped-query attention as two small matmuls, no copies
                qg = q.view(b, cfg.num_kv_heads, group, cfg.head_dim)
                sc = (qg @ kbuf[li][:, :, : col + 1].transpose(-1, -2)).float() * scale + neg
                o = torch.softmax(sc, -1).to(qg.dtype) @ vbuf[li][:, :, : col + 1]
                x = self._finish(blk, x, o.reshape(b, cfg.num_heads, 1, cfg.head_dim))
            logits = tgt.lm_head(tgt.norm(x[:, -1])).float()
        rows = out.tolist()
        lens = n_out.tolist()
        return [r[:n] for r, n in zip(rows, lens, strict=True)]


def _pick(logits: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
