"""The DSpark drafter: one parallel pass drafts a whole block of ``gamma`` tokens.

Design (why each part is there):

* Block-parallel backbone. The block's input is the anchor (the last committed token, whose
  target hidden state is not known yet) followed by ``gamma - 1`` copies of a learned mask
  embedding. A few transformer layers of the target's width run over the block with
  bidirectional attention inside it, so one forward pass yields all ``gamma`` positions:
  drafting costs one small pass instead of ``gamma`` sequential ones.
* Target conditioning. For every committed context position the target's hidden states at
  ``hidden_layers`` are concatenated, projected to the drafter width (``fc`` + RMSNorm) and
  turned into extra keys/values of every drafter layer (each layer's own K/V projections, RoPE
  at the absolute position). Every block position attends to them. The projection of a
  position depends on that position alone, so a per-request :class:`DrafterCache` keeps the
  per-layer context K/V and each committed token's features are projected exactly once. The
  context is capped to the last ``context_window`` positions (training masks the same way),
  which bounds CPU cost per step.
* Shared head. Embedding, final norm and LM head are the target's, frozen and never saved
  with the drafter: the drafter stays small and its logits live in the target's vocabulary.
* Low-rank Markov head. ``logits_k += U[x_{k-1}] @ V^T`` (rank ``markov_rank``), applied left
  to right with the previous *drafted* token, so ``q_k(x | x_{<k})`` is the exact distribution
  each draft was drawn from: the acceptance step can use it for ``min(1, p/q)``.
* Confidence head. ``z_k = w . [h_k ; U[x_{k-1}]] + b``, ``c_k = sigmoid(z_k / T_k)`` with
  optional per-position STS temperatures (SGLang's ``{"temperatures": [...]}`` JSON). It is
  trained towards the analytic acceptance ``1 - TV(p_k, q_k)``, i.e. the probability that
  draft k survives rejection sampling given that drafts ``1..k-1`` did.
* Greedy confidence head (``greedy_confidence``). Under greedy verification a draft survives
  iff it is the target's argmax, a different event from ``1 - TV``: a second linear head on
  the same features is trained towards ``1[argmax q_k == argmax p_k]``, and every request
  drafted at temperature 0 reads its confidence from it. STS temperatures are kept per
  sampling regime too (``sts.json`` for sampled requests, ``sts_greedy.json`` for greedy
  ones, both SGLang's format; without the greedy file greedy requests use ``sts.json``).
* Any gamma <= ``gamma_max``. The backbone always runs the trained block size
  (``gamma_max`` positions) and returns the first ``gamma``: a shorter block sees exactly the
  inputs it was trained on, so its drafts are the prefix of the full block's.

Decode-loop protocol (per request: a target KVCache and a :class:`DrafterCache`):

1. prefill the prompt with ``hidden_layers``; the first sampled token is the anchor; the
   prompt's hidden rows are the request's ``new_hidden``;
2. each step ``draft_batch(caches, anchors, gamma, temperatures, generators, new_hidden)``
   (appends ``new_hidden`` to each cache, then drafts); verify ``[anchor, drafts]`` with
   ``hidden_layers``; accept ``c`` drafts; truncate the target cache to the committed length;
   the next ``new_hidden`` = the verify pass's hidden rows ``[: c + 1]`` (anchor + accepted
   drafts); the bonus/corrected token becomes the next anchor.

Only committed positions' features ever enter a DrafterCache, so it never needs rollback.

Beside this module: the hyper-parameters (:mod:`~dspark_obs.engine.drafter_config`), the
layer on the target's RMSNorm and rope (:mod:`~dspark_obs.engine.drafter_layers`) and the
per-request context (:mod:`~dspark_obs.engine.drafter_cache`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark_obs.engine.drafter_cache import DrafterCache
from dspark_obs.engine.drafter_config import DrafterConfig, target_signature
from dspark_obs.engine.drafter_layers import DrafterNorm, DraftLayer
from dspark_obs.sts_file import load_temperatures

WEIGHTS_FILE = "drafter.safetensors"
CONFIG_FILE = "config.json"
STS_FILE = "sts.json"
STS_GREEDY_FILE = "sts_greedy.json"
STS_REGIMES = ("all", "sample", "greedy")


class ChainWeights(NamedTuple):
    """The tensors a greedy chain reads (:meth:`Drafter.greedy_chain_weights`)."""

    head: Tensor  # the draft head's rows [V', d] (V' = the draft vocabulary's size, or V)
    markov_u: Tensor  # U [V, r]: indexed by the previous token's id
    markov_v: Tensor  # V [V', r]: the draft vocabulary's rows
    ids: Tensor | None  # the draft vocabulary's ids (None: the whole vocabulary)
    conf_weight: Tensor  # [1, d + r]: the confidence head greedy rows read
    conf_bias: Tensor  # [1]


def greedy_chain(
    h: Tensor, base: Tensor, anchors: Tensor, sts: Tensor, w: ChainWeights
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The Markov recursion of greedy rows without q: (drafts [B, g], log q at the drafts,
    raw confidence logits, confidences ``sigmoid(z / sts)``). h [B, g, d] final-normed states,
    base [B, g, V'] logits (any float dtype: they are summed in float32).

    A pure function of tensors (no host values), so a compiled draft graph runs it as one
    function: per position the U row, the low-rank term, the argmax, log q and the
    confidence head, where eagerly each is its own kernels."""
    prev = anchors
    toks, lps, zs = [], [], []
    for k in range(h.shape[1]):
        u = F.embedding(prev, w.markov_u)
        lg = base[:, k].float() + (u @ w.markov_v.t()).float()
        x = torch.cat([h[:, k], u.to(h.dtype)], -1)
        zs.append(F.linear(x, w.conf_weight, w.conf_bias).float()[:, 0])
        tok = lg.argmax(-1)  # an index into the draft vocabulary (== the id without one)
        lps.append(lg.gather(1, tok[:, None])[:, 0] - torch.logsumexp(lg, -1))
        prev = tok if w.ids is None else w.ids[tok]
        toks.append(prev)
    z = torch.stack(zs, 1)
    return torch.stack(toks, 1), torch.stack(lps, 1), z, torch.sigmoid(z / sts)


@dataclass
class DraftBlock:
    """One drafted block (leading dim B for batched calls, absent for single requests).

    tokens [.., g] long; logprobs [.., g] = log q_k(token_k | drafts < k); probs [.., g, V]
    the exact q_k rows the tokens were drawn from (temperature applied; for greedy rows the
    temperature-1 distribution); conf_logits [.., g] raw z_k; confidence [.., g] =
    sigmoid(z_k / T_k).
    """

    tokens: Tensor
    logprobs: Tensor
    probs: Tensor
    conf_logits: Tensor
    confidence: Tensor

    @property
    def survival(self) -> Tensor:
        """S_j = prod_{i<=j} c_i: probability that drafts 1..j are all accepted."""
        return torch.cumprod(self.confidence, -1)

    def select(self, i: int) -> DraftBlock:
        return DraftBlock(*(getattr(self, f)[i] for f in _BLOCK_FIELDS))


_BLOCK_FIELDS = ("tokens", "logprobs", "probs", "conf_logits", "confidence")


# --------------------------------------------------------------------------- the drafter
class Drafter(nn.Module):
    """DSpark drafter sharing the (frozen) target's embedding, final norm and LM head."""

    def __init__(self, cfg: DrafterConfig, target: nn.Module):
        super().__init__()
        cfg.check_target(target)  # raises ValueError naming every mismatch
        self.cfg = cfg
        object.__setattr__(self, "_target", target)  # shared, not a submodule: never saved
        d = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.hidden_layers) * d, d, bias=False)
        self.ctx_norm = DrafterNorm(d, cfg.rms_eps)
        self.mask_embed = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.markov_u = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_v = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.markov_rank))
        self.conf_head = nn.Linear(d + cfg.markov_rank, 1)
        self.conf_head_greedy = (
            nn.Linear(d + cfg.markov_rank, 1) if cfg.greedy_confidence else None
        )
        self.register_buffer("sts_temperatures", torch.ones(0), persistent=False)
        self.register_buffer("sts_greedy_temperatures", torch.ones(0), persistent=False)
        # Token ids drafting may propose (empty: all); see set_draft_vocab.
        self.register_buffer("draft_vocab", torch.zeros(0, dtype=torch.long), persistent=False)
        self._draft_rows: tuple[tuple, Tensor, Tensor] | None = None
        self.reset_parameters()

    # -- init / target access -------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Small random init; residual outputs scaled down so the stack starts near identity."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "markov_v":
                nn.init.normal_(p, std=std)
            if name.endswith(("o_proj.weight", "down.weight")):
                p.data.mul_(1.0 / math.sqrt(2 * self.cfg.num_layers))
        with torch.no_grad():
            self.mask_embed.normal_(std=std)
            self.markov_v.zero_()
            self.conf_head.bias.fill_(1.0)
            if self.conf_head_greedy is not None:
                self.conf_head_greedy.bias.fill_(1.0)

    @property
    def target(self) -> Any:
        """The shared, frozen target (not a submodule: never saved, never moved)."""
        return self.__dict__["_target"]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Which target layers' outputs the drafter conditions on (concatenated in order)."""
        return self.cfg.hidden_layers

    def _draft_layers(self) -> list[DraftLayer]:
        return [m for m in self.layers if isinstance(m, DraftLayer)]

    def _embed(self, tokens: Tensor) -> Tensor:
        return _target_embed(self.target, tokens)

    def _final_norm(self, x: Tensor) -> Tensor:
        """The target's (frozen) final RMSNorm: drafter states live in its output space."""
        return self.target.norm(x)  # type: ignore[no-any-return]

    def _logits(self, h: Tensor) -> Tensor:
        return _target_lm_head(self.target, h)

    # -- reduced draft vocabulary ---------------------------------------------------------
    def set_draft_vocab(self, ids: Sequence[int] | Tensor | None) -> None:
        """Draft from these token ids only (None or empty: the whole vocabulary).

        Why: the LM head over the whole vocabulary at every block position is most of a
        draft's cost on a CPU. Lossless whatever the ids: greedy verification checks each
        draft against the target's argmax, and rejection sampling is exact for any draft
        distribution q as long as q is what the draft was sampled from; here q is the
        softmax over the kept ids (zero elsewhere, which the residual distribution covers).
        Only the acceptance rate can drop, when the drafter's favourite lies outside."""
        vocab = self.cfg.vocab_size
        t = torch.as_tensor([] if ids is None else ids, dtype=torch.long).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            raise ValueError(f"draft vocabulary ids must lie in 0..{vocab - 1}")
        self.draft_vocab = torch.unique(t).to(self.fc.weight.device)
        self._draft_rows = None

    def _head_weight(self) -> Tensor:
        """The target's LM-head rows [V, d] (its embedding when the head is tied)."""
        head = getattr(self.target, "output", None)
        return (head if head is not None else self.target.tok_embeddings).weight

    def _draft_weights(self) -> tuple[Tensor, Tensor]:
        """(LM-head rows, Markov V rows) of the draft vocabulary, gathered once per change
        of the weights, the ids, their device or dtype."""
        weight = self._head_weight()
        ids = self.draft_vocab
        key = (weight.data_ptr(), weight._version, weight.dtype, self.markov_v.data_ptr(),
               self.markov_v._version, self.markov_v.dtype, ids.data_ptr(), ids.numel())
        if self._draft_rows is None or self._draft_rows[0] != key:
            self._draft_rows = (key, weight[ids].contiguous(), self.markov_v[ids].contiguous())
        return self._draft_rows[1], self._draft_rows[2]

    def draft_logits(self, h: Tensor) -> Tensor:
        """Base logits of drafting [.., V'] (V' = the draft vocabulary's size, or V)."""
        if not self.draft_vocab.numel():
            return self._logits(h)
        w, _ = self._draft_weights()
        return F.linear(h.to(w.dtype), w)

    def greedy_chain_weights(self) -> ChainWeights:
        """What :func:`greedy_chain` reads, as plain tensors (a compiled caller takes them as
        arguments): the draft head's rows, U, V (the draft vocabulary's rows), the ids (None:
        the whole vocabulary) and the confidence head greedy rows read."""
        ids = self.draft_vocab if self.draft_vocab.numel() else None
        rows, mv = (self._head_weight(), self.markov_v) if ids is None else self._draft_weights()
        conf = self.conf_head_greedy if self.conf_head_greedy is not None else self.conf_head
        return ChainWeights(rows, self.markov_u.weight, mv, ids, conf.weight, conf.bias)

    # -- shared pieces ---------------------------------------------------------------------
    def project_context(self, hidden: Tensor) -> Tensor:
        """[.., L*d] concatenated target hidden states -> [.., d] normalized features."""
        w = self.fc.weight
        return self.ctx_norm(self.fc(hidden.to(w.dtype)))

    def _block_input(self, anchors: Tensor, gamma: int) -> Tensor:
        """[B, gamma, d]: anchor embedding then gamma-1 mask embeddings."""
        e = self._embed(anchors.reshape(-1)).to(self.mask_embed.dtype)  # [B, d]
        m = self.mask_embed.expand(e.shape[0], gamma - 1, -1)
        return torch.cat([e.unsqueeze(1), m], 1)

    def _markov(self, base: Tensor, prev: Tensor) -> tuple[Tensor, Tensor]:
        """Logits base [.., V] + U[prev] V^T, and U[prev] (for the confidence head)."""
        u = self.markov_u(prev)
        return base.float() + (u @ self.markov_v.t()).float(), u

    def _conf(self, h: Tensor, u: Tensor) -> Tensor:
        """Raw confidence logits: [..] (sampling head) or [.., 2] (sampling, greedy heads)."""
        x = torch.cat([h, u.to(h.dtype)], -1)
        z = self.conf_head(x).float()
        if self.conf_head_greedy is not None:
            return torch.cat([z, self.conf_head_greedy(x).float()], -1)
        return z.squeeze(-1)

    def sts(self, gamma: int, greedy: bool = False) -> Tensor:
        """Per-position STS temperatures of one sampling regime (ones if none): greedy requests
        use the greedy temperatures when installed, else the shared ones."""
        t = self.sts_temperatures
        if greedy and self.sts_greedy_temperatures.numel():
            t = self.sts_greedy_temperatures
        if t.numel() == 0:
            return torch.ones(gamma)
        if t.numel() < gamma:
            raise ValueError(f"STS has {t.numel()} temperatures, gamma={gamma}")
        return t[:gamma].cpu()

    def set_sts(
        self, temperatures: Sequence[float] | str | Path | None, regime: str = "all"
    ) -> None:
        """Install STS temperatures (a list or SGLang's JSON file); None removes them.

        ``regime`` "all" (every request: what a user-supplied file means), "sample" (requests
        at temperature > 0) or "greedy" (temperature 0 requests).
        """
        if regime not in STS_REGIMES:
            raise ValueError(f"STS regime {regime!r} is not one of {STS_REGIMES}")
        if temperatures is None:
            t = torch.ones(0)
        else:
            temps = (
                load_temperatures(temperatures)
                if isinstance(temperatures, str | Path)
                else temperatures
            )
            t = torch.tensor([float(x) for x in temps], dtype=torch.float32)
            if t.numel() == 0 or not torch.isfinite(t).all() or (t <= 0).any():
                raise ValueError("STS temperatures must be finite and > 0")
        if regime in ("all", "sample"):
            self.sts_temperatures = t
        if regime in ("all", "greedy"):
            self.sts_greedy_temperatures = torch.ones(0) if regime == "all" else t

    # -- training forward: many blocks per sequence ----------------------------------------
    def forward_train(
        self,
        hidden: Tensor,
        tokens: Tensor,
        anchors: Tensor,
        gamma: int,
        lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Teacher-forced block pass for training.

        hidden [B, T, L*d] target features of every position, tokens [B, T], anchors [B, nb]
        (anchor a sees context positions < a). Returns the final normalized block states
        h [B, nb, gamma, d], logits [B, nb, gamma, V] (Markov term with the realized previous
        token) and conf logits z [B, nb, gamma] (with a greedy head [B, nb, gamma, 2]: sampling
        head, greedy head). Block position k predicts token a + k + 1.
        """
        cfg = self.cfg
        b, t_len = tokens.shape
        nb = anchors.shape[1]
        dev = tokens.device
        feats = self.project_context(hidden)  # [B, T, d]
        ctx_pos = torch.arange(t_len, device=dev).expand(b, t_len)
        offs = torch.arange(gamma, device=dev)
        blk_pos = (anchors.unsqueeze(-1) + offs).reshape(b, nb * gamma)  # [B, Q]
        anchor_tok = tokens.gather(1, anchors)  # the anchor TOKEN at each anchor position
        x = self._block_input(anchor_tok.reshape(-1), gamma).view(b, nb * gamma, -1)
        # mask: context t visible iff a - W <= t < a; block keys iff same block
        a_q = anchors.repeat_interleave(gamma, 1)  # [B, Q]
        t_idx = torch.arange(t_len, device=dev)
        ctx_ok = (t_idx < a_q.unsqueeze(-1)) & (t_idx >= a_q.unsqueeze(-1) - cfg.context_window)
        blk_id = torch.arange(nb, device=dev).repeat_interleave(gamma)
        blk_ok = (blk_id.unsqueeze(1) == blk_id.unsqueeze(0)).expand(b, -1, -1)
        mask = torch.cat([ctx_ok, blk_ok], -1).unsqueeze(1)
        for layer in self._draft_layers():
            ck, cv = layer.kv(feats, ctx_pos)
            x = layer(x, blk_pos, ck, cv, mask)
        h = self._final_norm(x)
        base = self._logits(h)
        prev_pos = blk_pos.clamp(max=t_len - 1)
        prev = tokens.gather(1, prev_pos)  # token at a + k (k = 0 is the anchor)
        logits, u = self._markov(base, prev)
        z = self._conf(h, u)
        return (
            h.view(b, nb, gamma, -1),
            logits.view(b, nb, gamma, -1),
            z.view(b, nb, gamma, *z.shape[2:]),
        )

    # -- inference ------------------------------------------------------------------------
    def new_cache(self) -> DrafterCache:
        """An empty per-request context cache."""
        return DrafterCache()

    @torch.no_grad()
    def extend(self, cache: DrafterCache, hidden: Tensor) -> None:
        """Append committed positions' target features [n, L*d] (each projected once)."""
        if hidden.numel() == 0:
            return
        n = hidden.shape[0]
        dev = self.fc.weight.device
        feats = self.project_context(hidden.to(dev)).unsqueeze(0)  # [1, n, d]
        pos = torch.arange(cache.num_positions, cache.num_positions + n, device=dev)[None]
        new_k, new_v = [], []
        for i, layer in enumerate(self._draft_layers()):
            k, v = layer.kv(feats, pos)
            k, v = k[0], v[0]  # [kvh, n, hd]
            if cache.keys:
                k = torch.cat([cache.keys[i], k], 1)
                v = torch.cat([cache.values[i], v], 1)
            w = self.cfg.context_window
            new_k.append(k[:, -w:])
            new_v.append(v[:, -w:])
        cache.keys, cache.values = new_k, new_v
        cache.num_positions += n

    @torch.no_grad()
    def draft_batch(
        self,
        caches: Sequence[DrafterCache],
        anchors: Sequence[int] | Tensor,
        gamma: int = 5,
        temperature: float | Sequence[float] = 0.0,
        generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
        new_hidden: Sequence[Tensor | None] | None = None,
    ) -> DraftBlock:
        """Draft one block for each request (tensors [B, gamma, ...]).

        new_hidden[i] (optional) are request i's newly committed positions' features,
        appended to caches[i] first. temperature <= 0 means greedy (argmax); otherwise tokens
        are sampled from q_k at that temperature. Probabilities are exact left to right.
        """
        cfg = self.cfg
        if not 1 <= gamma <= cfg.gamma_max:
            raise ValueError(f"gamma={gamma} outside 1..{cfg.gamma_max}")
        bsz = len(caches)
        if new_hidden is not None:
            for c, hnew in zip(caches, new_hidden, strict=True):
                if hnew is not None:
                    self.extend(c, hnew)
        dev = self.fc.weight.device
        dtype = self.fc.weight.dtype
        anc = torch.as_tensor(anchors, dtype=torch.long).reshape(-1).to(dev)
        temps = torch.as_tensor(temperature, dtype=torch.float32).reshape(-1).expand(bsz)
        # padded context K/V
        c_max = max(c.length for c in caches)
        kvh, hd = cfg.num_kv_heads, cfg.head_dim
        g_run = cfg.gamma_max  # always the trained block size; the first gamma are returned
        keymask = torch.zeros(bsz, c_max + g_run, dtype=torch.bool, device=dev)
        keymask[:, c_max:] = True
        ctx_k = [torch.zeros(bsz, kvh, c_max, hd, device=dev, dtype=dtype) for _ in self.layers]
        ctx_v = [torch.zeros(bsz, kvh, c_max, hd, device=dev, dtype=dtype) for _ in self.layers]
        for i, c in enumerate(caches):
            n = c.length
            keymask[i, :n] = True
            for li in range(len(self.layers)):
                ctx_k[li][i, :, :n] = c.keys[li]
                ctx_v[li][i, :, :n] = c.values[li]
        mask = keymask[:, None, None, :].expand(bsz, 1, g_run, c_max + g_run)
        pos = torch.tensor([c.num_positions for c in caches], device=dev)
        pos = pos[:, None] + torch.arange(g_run, device=dev)
        x = self._block_input(anc, g_run)
        for li, layer in enumerate(self.layers):
            x = layer(x, pos, ctx_k[li], ctx_v[li], mask)
        h = self._final_norm(x[:, :gamma])
        base = self.draft_logits(h).float()  # [B, gamma, V'] (V' = the draft vocabulary)
        return self.chain(h, base, anc, temps.to(dev), generator)

    def chain(
        self,
        h: Tensor,
        base: Tensor,
        anchors: Tensor,
        temps: Tensor,
        generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
        *,
        sts: Tensor | None = None,
        all_greedy: bool | None = None,
        with_probs: bool = True,
    ) -> DraftBlock:
        """Left-to-right Markov recursion over a block's states: the drafts, their exact q_k
        rows and the confidences. h [B, g, d] final-normed states, base [B, g, V'] logits
        from :meth:`draft_logits` (summed in float32), anchors [B], temps [B] (<= 0: greedy),
        on h's device. ``probs`` are always over the whole vocabulary.

        ``sts`` [B, g] (the regime's STS temperatures per row) and ``all_greedy`` let a caller
        that cannot sync with the host (a CUDA graph capture) pass what would be looked up.
        ``with_probs=False`` with every row greedy leaves ``probs`` empty: greedy acceptance
        never reads q, and a block's q rows are ``B * g * V`` floats written per step.
        """
        gamma = h.shape[1]
        dev = h.device
        greedy = temps <= 0
        if sts is None:
            sts = torch.where(
                greedy[:, None], self.sts(gamma, greedy=True).to(dev), self.sts(gamma).to(dev)
            )
        if all_greedy is None:
            all_greedy = bool(greedy.all())
        if all_greedy and not with_probs:  # log q at the argmax, without q itself
            tokens, logprobs, z, confidence = greedy_chain(
                h, base, anchors, sts, self.greedy_chain_weights()
            )
            return DraftBlock(tokens, logprobs, base.new_zeros(0, dtype=torch.float32), z,
                              confidence)  # fmt: skip
        tsafe = torch.where(greedy, torch.ones_like(temps), temps)
        ids = self.draft_vocab if self.draft_vocab.numel() else None
        mv = self.markov_v if ids is None else self._draft_weights()[1]
        toks, lps, probs, zs = [], [], [], []
        prev = anchors
        for k in range(gamma):
            u = self.markov_u(prev)
            lg = base[:, k].float() + (u @ mv.t()).float()
            zs.append(self._conf(h[:, k], u))
            tok = lg.argmax(-1)  # an index into the draft vocabulary (== the id without one)
            q = torch.softmax(lg / tsafe[:, None], -1)
            if not all_greedy:
                tok = torch.where(greedy, tok, _sample_rows(q, generator, greedy))
            lps.append(torch.log(q.gather(1, tok[:, None])[:, 0].clamp_min(1e-30)))
            if ids is not None:
                q = q.new_zeros(q.shape[0], self.cfg.vocab_size).index_copy_(1, ids, q)
            probs.append(q)
            if ids is not None:
                tok = ids[tok]
            toks.append(tok)
            prev = tok
        z = torch.stack(zs, 1)
        if z.dim() == 3:  # per request: the head of its sampling regime
            z = torch.where(greedy[:, None], z[..., 1], z[..., 0])
        return DraftBlock(
            tokens=torch.stack(toks, 1),
            logprobs=torch.stack(lps, 1),
            probs=torch.stack(probs, 1),
            conf_logits=z,
            confidence=torch.sigmoid(z / sts),
        )

    def draft(
        self,
        ctx_hidden: Tensor | None,
        anchor_token: int | Tensor,
        gamma: int = 5,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        cache: DrafterCache | None = None,
    ) -> DraftBlock:
        """Single-request draft (tensors [gamma, ...]).

        Without ``cache`` ctx_hidden is the whole context's features [n, L*d]; with a cache
        it is only the newly committed positions (or None), appended before drafting.
        """
        c = cache if cache is not None else self.new_cache()
        blk = self.draft_batch(
            [c], [int(anchor_token)], gamma, temperature, generator, [ctx_hidden]
        )
        return blk.select(0)

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write ``drafter.safetensors`` (bf16) + ``config.json`` (+ the STS files) into path."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        sd = {
            k: v.detach().to("cpu", torch.bfloat16).contiguous()
            for k, v in self.state_dict().items()
        }
        save_file(sd, str(out / WEIGHTS_FILE))
        conf = {"drafter": self.cfg.to_json(), "target": target_signature(self.target)}
        if meta:
            conf["meta"] = meta
        (out / CONFIG_FILE).write_text(json.dumps(conf, indent=2))
        sts_files = (
            (STS_FILE, self.sts_temperatures),
            (STS_GREEDY_FILE, self.sts_greedy_temperatures),
        )
        for name, t in sts_files:
            if t.numel():
                (out / name).write_text(json.dumps({"temperatures": t.tolist()}, indent=2))
        return out

    @classmethod
    def load(
        cls, path: str | Path, target: nn.Module, device: str | torch.device | None = None
    ) -> Drafter:
        """Load a saved drafter onto ``target``; shape mismatches raise ValueError."""
        from safetensors.torch import load_file

        p = Path(path)
        conf = json.loads((p / CONFIG_FILE).read_text())
        cfg = DrafterConfig.from_json(conf["drafter"])
        drafter = cls(cfg, target)  # raises ValueError on target mismatch
        sd = load_file(str(p / WEIGHTS_FILE))
        own = drafter.state_dict()
        bad = [
            f"{k}: file {tuple(v.shape)} != model {tuple(own[k].shape)}"
            for k, v in sd.items()
            if k in own and tuple(v.shape) != tuple(own[k].shape)
        ]
        missing = sorted(set(own) - set(sd))
        if bad or missing:
            raise ValueError(f"checkpoint mismatch: {bad} missing={missing}")
        drafter.load_state_dict({k: v.float() for k, v in sd.items()})
        if (p / STS_FILE).exists():
            drafter.set_sts(p / STS_FILE)
        if (p / STS_GREEDY_FILE).exists():
            drafter.set_sts(p / STS_GREEDY_FILE, regime="greedy")
        dev = device if device is not None else _target_device(target)
        return drafter.to(dev).eval()


def _sample_rows(
    q: Tensor,
    generator: torch.Generator | Sequence[torch.Generator | None] | None,
    skip: Tensor,
) -> Tensor:
    """One sample per row of q [B, V]: per-request generators (reproducible per request
    whatever the batch: greedy rows in ``skip`` draw nothing) or one shared generator (one
    vectorized call)."""
    if isinstance(generator, Sequence):
        out = []
        for i, g in enumerate(generator):
            if bool(skip[i]):
                out.append(q[i].argmax().reshape(1))
                continue
            qi = q[i] if g is None or g.device == q.device else q[i].to(g.device)
            out.append(torch.multinomial(qi, 1, generator=g).to(q.device))
        return torch.cat(out)
    qq = q if generator is None or generator.device == q.device else q.to(generator.device)
    return torch.multinomial(qq, 1, generator=generator)[:, 0].to(q.device)


# --------------------------------------------------------------------------- target helpers
def _target_device(target: nn.Module) -> torch.device:
    for prm in target.parameters():
        return prm.device
    return torch.device("cpu")


def _target_embed(target: Any, tokens: Tensor) -> Tensor:
    return target.embed(tokens)  # type: ignore[no-any-return]


def _target_lm_head(target: Any, h: Tensor) -> Tensor:
    """Target's LM head on normalized drafter states (shape-preserving over leading dims)."""
    lead = h.shape[:-1]
    w = getattr(target, "dtype", h.dtype)
    out = target.lm_head(h.reshape(-1, h.shape[-1]).to(w))
    return out.reshape(*lead, out.shape[-1])  # type: ignore[no-any-return]


def missing_checkpoint_files(path: str | Path) -> list[Path]:
    """The files a saved drafter needs (config, weights) that ``path`` lacks, so a caller can
    say which one is missing instead of failing deep inside the loader."""
    p = Path(path)
    return [p / name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (p / name).is_file()]
