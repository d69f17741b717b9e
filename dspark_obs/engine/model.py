"""The embedded target model: a small, readable Llama (SmolLM2-135M's architecture).

Everything the DSpark engine needs from a target lives here and nowhere else:

* :class:`ModelConfig` - the architecture numbers (SmolLM2-135M, or tiny ones for tests).
* :class:`KVCache` - one per request, preallocated, with an explicit ``length`` and a
  ``truncate(n)`` that rolls back rejected draft positions in O(1).
* :class:`Target` - a Llama decoder (RMSNorm, rotary embeddings, grouped-query attention,
  SwiGLU MLP, tied embeddings) whose ``forward`` is *ragged*: every request brings its own
  number of new tokens; they are packed into one ``[sum n_i, d]`` sequence for all the
  dense layers, and only attention runs per request, against that request's own cache.
  This is what makes ``compact`` verification really cheaper than ``static``: no padding to
  the widest request, so the target processes exactly ``sum(verify_len)`` tokens.

Weight layout follows the Hugging Face Llama convention (rotate-half RoPE, q/k rows not
interleaved); :mod:`dspark_obs.engine.weights` converts llama.cpp's GGUF layout into it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CacheOverflowError",
    "KVCache",
    "ModelConfig",
    "Target",
    "TargetOutput",
]


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a Llama-style decoder; frozen so caches and models agree."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                f"{self.num_kv_heads} (grouped-query attention needs equal groups)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M(-Instruct); numbers checked against the GGUF's ``llama.*`` metadata."""
        return cls(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            max_position=8192,
            tie_embeddings=True,
        )

    @classmethod
    def tiny(cls, **overrides: object) -> ModelConfig:
        """A ~80k-parameter model of the same architecture, for fast unit tests."""
        base = cls(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            max_position=512,
            tie_embeddings=True,
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown ModelConfig field(s): {sorted(unknown)}")
        return replace(base, **overrides)  # type: ignore[arg-type]


class CacheOverflowError(ValueError):
    """Raised before any write when new tokens would not fit in a request's KVCache."""


class KVCache:
    """Keys and values of one request, preallocated as ``[layers, 2, kv_heads, max_len, hd]``.

    Positions ``[0, length)`` are valid. ``Target.forward`` writes the new tokens' K/V at
    ``[length, length + n)`` and then advances ``length``; ``truncate(n)`` just moves the
    end back (stale entries past ``length`` are never read and get overwritten), which is
    exactly what rejecting drafts needs.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 0 < max_len <= cfg.max_position:
            raise ValueError(
                f"max_len must be in 1..{cfg.max_position} (the model's context), got {max_len}"
            )
        self.cfg = cfg
        self.max_len = max_len
        self.kv = torch.zeros(
            cfg.num_layers,
            2,
            cfg.num_kv_heads,
            max_len,
            cfg.head_dim,
            device=device,
            dtype=dtype,
        )
        self._length = 0

    @property
    def length(self) -> int:
        """Number of cached (committed or being-verified) positions."""
        return self._length

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def dtype(self) -> torch.dtype:
        return self.kv.dtype

    @property
    def free(self) -> int:
        return self.max_len - self._length

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions (roll back rejected drafts)."""
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {n}")
        self._length = n

    def reset(self) -> None:
        self._length = 0

    def _advance(self, n: int) -> None:
        # Only Target.forward calls this, after it has written positions [length, length+n).
        self._length += n

    def check_room(self, n: int) -> None:
        """Fail loudly (and before touching anything) if ``n`` more tokens do not fit."""
        if self._length + n > self.max_len:
            raise CacheOverflowError(
                f"KVCache overflow: length {self._length} + {n} new tokens > max_len "
                f"{self.max_len}; allocate the cache with max_len >= prompt + max_new_tokens "
                f"+ gamma + 1"
            )

    def __repr__(self) -> str:
        return (
            f"KVCache(length={self._length}, max_len={self.max_len}, "
            f"dtype={self.dtype}, device={self.device})"
        )


@dataclass
class TargetOutput:
    """Per-request results of one ragged forward, in the order the requests were given."""

    logits: list[Tensor]  # [n_i, vocab] float32 (or [1, vocab] with last_logits_only)
    hidden: list[Tensor]  # [n_i, len(hidden_layers) * hidden_size], model dtype


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 so bf16 runs stay stable."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:class:`RMSNorm` as a function (what a compiled layer calls with the same numbers)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_cos_sin(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[n, head_dim/2]`` for absolute positions (computed in float32)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (
        torch.arange(half, device=positions.device, dtype=torch.float32) * 2.0 / head_dim
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [n, heads, head_dim]``; dimension i pairs with i + head_dim/2 (HF layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@dataclass
class Span:
    """Where one request sits in the packed sequence, and its attention mask (built once
    per forward, shared by all layers)."""

    cache: KVCache
    start: int  # first row of this request in the packed [sum n_i, d] sequence
    n: int  # new tokens
    past: int  # cache.length before this forward
    mask: Tensor | None  # [group * n, past + n] bool, None when n == 1 (sees everything)

    @classmethod
    def build(cls, cache: KVCache, start: int, n: int, group: int) -> Span:
        past = cache.length
        mask = None
        if n > 1:  # causal within the new tokens, everything cached before them is visible
            dev = cache.device
            qpos = past + torch.arange(n, device=dev).repeat(group)
            mask = torch.arange(past + n, device=dev)[None, :] <= qpos[:, None]
        return cls(cache, start, n, past, mask)


class Attention(nn.Module):
    """Grouped-query attention; projections run packed, the softmax runs per request."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # q, k and v share one matmul over the packed tokens.
        self.wqkv = nn.Linear(cfg.hidden_size, cfg.hidden_size + 2 * cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, spans: list[Span]) -> Tensor:
        cfg = self.cfg
        hd, n_kv = cfg.head_dim, cfg.num_kv_heads
        group = cfg.num_heads // n_kv
        q, k, v = self.wqkv(x).split((cfg.hidden_size, cfg.kv_dim, cfg.kv_dim), dim=-1)
        q = apply_rope(q.view(-1, cfg.num_heads, hd), cos, sin)
        k = apply_rope(k.view(-1, n_kv, hd), cos, sin)
        v = v.view(-1, n_kv, hd)

        outs = []
        for sp in spans:
            start, end, total = sp.start, sp.start + sp.n, sp.past + sp.n
            # Append this request's new K/V, then attend over its positions [0, past + n).
            kv = sp.cache.kv[layer]  # [2, kv_heads, max_len, hd]
            kv[0, :, sp.past : total] = k[start:end].transpose(0, 1)
            kv[1, :, sp.past : total] = v[start:end].transpose(0, 1)
            # Query heads kv*group .. kv*group+group-1 share kv head `kv`: fold the group
            # into the query-length axis so no K/V copy is needed: [kv_heads, group*n, hd].
            qr = q[start:end].view(sp.n, n_kv, group, hd).permute(1, 2, 0, 3)
            qr = qr.reshape(1, n_kv, group * sp.n, hd)
            # 4-D inputs select the fused kernels (CPU flash, CUDA mem-efficient).
            o = F.scaled_dot_product_attention(
                qr, kv[0, None, :, :total], kv[1, None, :, :total], attn_mask=sp.mask
            )
            # back to [n, heads * hd] with heads ordered kv*group + g
            outs.append(o.view(n_kv, group, sp.n, hd).permute(2, 0, 1, 3).reshape(sp.n, -1))
        return self.wo(torch.cat(outs) if len(outs) > 1 else outs[0])


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layer: int, spans: list[Span]) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, layer, spans)
        return x + self.mlp(self.mlp_norm(x))


class Target(nn.Module):
    """Llama decoder with a ragged, cache-aware forward (see the module docstring).

    ``forward`` runs under ``torch.no_grad()``: the target is never trained, and gradients
    must not leak into the KV caches. ``embed`` / ``norm`` / ``lm_head`` are plain modules
    and methods so a drafter can share them (and backpropagate through them into its own
    parameters) while keeping them frozen.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # An explicit weight skips nn.Embedding's own init, which on the "meta" device (used
        # when loading real weights) would import torch._dynamo for a normal_() (~2 s).
        self.tok_embeddings = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.tokens_processed = 0  # sum of n_i over all forwards (compact-mode accounting)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init (normal(0, std), unit norms): random tiny models behave sanely."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | RMSNorm) and module.weight.is_meta:
                continue  # built on "meta" only to receive loaded weights; skip the work
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # -- pieces shared with the drafter -------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def embed(self, tokens: Tensor) -> Tensor:
        """Token ids ``[...]`` -> embeddings ``[..., hidden]`` (model dtype)."""
        return self.tok_embeddings(tokens.to(self.device))

    def lm_head(self, h: Tensor) -> Tensor:
        """Hidden ``[..., hidden]`` -> logits ``[..., vocab]``; the final norm is NOT applied
        here (call ``target.norm(h)`` first when ``h`` is a raw residual stream)."""
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, weight)

    def new_cache(self, max_len: int) -> KVCache:
        """A KVCache on this model's device and dtype."""
        return KVCache(self.cfg, max_len, device=self.device, dtype=self.dtype)

    # -- the ragged forward ---------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        tokens: Sequence[Tensor],
        caches: Sequence[KVCache],
        hidden_layers: Sequence[int] = (),
        *,
        last_logits_only: bool = False,
    ) -> TargetOutput:
        """Run the new tokens of every request, appending their K/V to the caches.

        ``tokens[i]`` is a 1-D LongTensor of request i's new tokens, placed at positions
        ``caches[i].length + arange(n_i)``. ``hidden_layers`` lists decoder-layer indices
        (0-based) whose *output* residual stream is returned, concatenated in the given
        order; index ``l`` equals Hugging Face's ``hidden_states[l + 1]`` (never normed).
        ``last_logits_only`` returns ``[1, vocab]`` logits per request (prefill saves
        ``n_i * vocab`` floats).
        """
        cfg = self.cfg
        if len(tokens) != len(caches):
            raise ValueError(f"{len(tokens)} token tensors but {len(caches)} caches")
        if not tokens:
            raise ValueError("forward needs at least one request")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("the same KVCache was passed for two requests")
        layers = tuple(int(i) for i in hidden_layers)
        for i in layers:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"hidden layer {i} out of range [0, {cfg.num_layers})")
        lengths = []
        for i, (t, cache) in enumerate(zip(tokens, caches, strict=True)):
            if t.dim() != 1 or t.numel() == 0:
                raise ValueError(f"request {i}: tokens must be a non-empty 1-D tensor")
            if cache.cfg != cfg:
                raise ValueError(f"request {i}: KVCache was built for a different ModelConfig")
            if cache.dtype != self.dtype or cache.device != self.device:
                raise ValueError(
                    f"request {i}: KVCache is {cache.dtype} on {cache.device}, model is "
                    f"{self.dtype} on {self.device}"
                )
            cache.check_room(t.numel())
            lengths.append(t.numel())

        device = self.device
        x = self.embed(torch.cat([t.to(device) for t in tokens]))  # [N, d] packed
        positions = torch.cat(
            [
                torch.arange(c.length, c.length + n, device=device)
                for c, n in zip(caches, lengths, strict=True)
            ]
        )
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)

        group = cfg.num_heads // cfg.num_kv_heads
        starts = [0, *itertools.accumulate(lengths)][:-1]
        spans = [
            Span.build(c, s, n, group) for c, s, n in zip(caches, starts, lengths, strict=True)
        ]

        captured: dict[int, Tensor] = {}
        wanted = set(layers)
        for idx, block in enumerate(self.layers):
            x = block(x, cos, sin, idx, spans)
            if idx in wanted:
                captured[idx] = x
        for cache, n in zip(caches, lengths, strict=True):
            cache._advance(n)
        self.tokens_processed += sum(lengths)

        if last_logits_only:
            ends = torch.tensor(lengths, device=device).cumsum(0) - 1
            logits = self.lm_head(self.norm(x[ends])).float().split(1)
        else:
            logits = self.lm_head(self.norm(x)).float().split(lengths)
        if layers:
            hidden = torch.cat([captured[i] for i in layers], dim=-1).split(lengths)
        else:
            hidden = x.new_empty(x.shape[0], 0).split(lengths)
        return TargetOutput(logits=list(logits), hidden=list(hidden))

    def prefill(
        self,
        prompt_ids: Sequence[int] | Tensor,
        cache: KVCache,
        hidden_layers: Sequence[int] = (),
    ) -> TargetOutput:
        """Run one request's prompt: logits ``[1, vocab]`` for the LAST prompt position only
        (what the first sampled token needs) and hidden ``[n, k * hidden]`` for all."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        return self.forward([ids], [cache], hidden_layers, last_logits_only=True)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
