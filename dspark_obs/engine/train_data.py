"""Training data: the target's own responses to workload prompts, and their batch order.

Responses are generated *by the target* for train-split prompts of the workloads (math,
chat, poetry), greedy and temperature-1, so the drafter learns the target's distribution
rather than a dataset's. Batches and anchors are a function of ``seed`` and the step number
alone, so a resumed run sees the same data in the same order.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save through a temporary file and a rename: a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


@dataclass
class TrainData:
    """Target-generated training sequences (prompt + response token ids)."""

    seqs: list[list[int]]
    prompt_lens: list[int]
    workloads: list[str]
    modes: list[str]  # "greedy" | "sample"
    info: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        atomic_save(
            {
                "seqs": self.seqs,
                "prompt_lens": self.prompt_lens,
                "workloads": self.workloads,
                "modes": self.modes,
                "info": self.info,
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> TrainData:
        d = torch.load(path, weights_only=False)
        return cls(d["seqs"], d["prompt_lens"], d["workloads"], d["modes"], d.get("info", {}))


def encoded_prompts(
    tokenizer: Any, workload: str, split: str, n: int | None, seed: int, max_prompt_tokens: int
) -> list[tuple[list[int], Any]]:
    """(chat-templated prompt ids, Prompt) for ``n`` prompts (all when None) of one
    workload's ``split``; over-long prompts are dropped."""
    from dspark_obs.engine.weights import encode_chat
    from dspark_obs.workloads import load_prompts

    out: list[tuple[list[int], Any]] = []
    for pr in load_prompts(workload, split, n, seed):
        ids = encode_chat(tokenizer, pr.messages)
        if len(ids) <= max_prompt_tokens:
            out.append((ids, pr))
    return out


def workload_prompts(
    tokenizer: Any,
    workloads: Sequence[str],
    counts: int | Mapping[str, int],
    split: str,
    seed: int,
    max_prompt_tokens: int,
) -> list[tuple[str, list[int]]]:
    """(workload, prompt ids) for each workload's prompts; over-long prompts are dropped."""
    out: list[tuple[str, list[int]]] = []
    for w in workloads:
        n = counts[w] if isinstance(counts, Mapping) else counts
        rows = encoded_prompts(tokenizer, w, split, n, seed, max_prompt_tokens)
        out.extend((w, ids) for ids, _ in rows)
    return out


def _sorted_generate(
    runner: Any,
    prompts: Sequence[Sequence[int]],
    indices: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    gen: torch.Generator,
    eos_ids: Sequence[int],
    gen_batch_size: int,
) -> Iterator[tuple[list[int], list[list[int]], int]]:
    """Generate for ``prompts[i]``, i in ``indices``, in length-sorted batches (similar
    prompt lengths waste less padding / compute). Yields (batch indices, their responses,
    prompts done so far) one batch at a time, so callers can log between batches."""
    order = sorted(indices, key=lambda i: len(prompts[i]))
    for s in range(0, len(order), gen_batch_size):
        idx = order[s : s + gen_batch_size]
        batch = [prompts[i] for i in idx]
        outs = runner.generate(batch, max_new_tokens, temperature, gen, eos_ids)
        yield idx, outs, min(s + gen_batch_size, len(order))


def build_train_data(
    runner: Any,
    prompts: Sequence[tuple[str, Sequence[int]]],
    max_new_tokens: int,
    modes: Sequence[str],
    eos_ids: Sequence[int],
    seed: int,
    gen_batch_size: int,
    log: Callable[[str], None] = print,
    one_mode_per_prompt: bool = False,
) -> TrainData:
    """Generate the target's responses (greedy and/or temperature-1) for every prompt, or,
    with ``one_mode_per_prompt``, prompt i answered once in mode ``modes[i % len(modes)]``."""
    data = TrainData([], [], [], [])
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    t0 = time.time()
    ntok = 0
    ids = [p for _, p in prompts]
    for m, mode in enumerate(modes):
        temp = 0.0 if mode == "greedy" else 1.0
        mine = [
            i for i in range(len(prompts)) if not one_mode_per_prompt or i % len(modes) == m
        ]
        batches = _sorted_generate(
            runner, ids, mine, max_new_tokens, temp, gen, eos_ids, gen_batch_size
        )
        for idx, outs, done in batches:
            for i, resp in zip(idx, outs, strict=True):
                if len(resp) < 2:
                    continue
                w, p = prompts[i]
                data.seqs.append(list(p) + resp)
                data.prompt_lens.append(len(p))
                data.workloads.append(w)
                data.modes.append(mode)
                ntok += len(resp)
            log(
                f"[gen] {mode} {done}/{len(mine)} prompts, "
                f"{ntok} tokens, {ntok / max(time.time() - t0, 1e-9):.0f} tok/s"
            )
    data.info = {
        "max_new_tokens": max_new_tokens,
        "modes": list(modes),
        "tokens": ntok,
        "one_mode_per_prompt": one_mode_per_prompt,
    }
    return data


def variant_prompts(
    runner: Any,
    requests: Sequence[tuple[str, Sequence[int]]],
    wraps: Mapping[str, tuple[Sequence[int], Sequence[int]]],
    max_new_tokens: int,
    temperature: float,
    eos_ids: Sequence[int],
    seed: int,
    gen_batch_size: int,
    min_tokens: int = 8,
    log: Callable[[str], None] = print,
) -> list[tuple[str, list[int]]]:
    """New prompts written by the target itself: each request (workload, chat ids asking
    for a new problem / question / verse like a train prompt) is answered once, and the
    answer becomes the user message of a new prompt, ``prefix + answer + suffix`` from the
    workload's ``wraps`` (the chat template around the workload's instruction). Answers
    cut off at the limit or shorter than ``min_tokens`` are dropped.

    Why: the drafter overfits the phrasing of its train prompts' templates; the target's
    own variants give many more distinct prompts whose responses it then writes."""
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    eos = set(int(e) for e in eos_ids)
    out: list[tuple[str, list[int]]] = []
    ids = [r for _, r in requests]
    batches = _sorted_generate(
        runner, ids, range(len(ids)), max_new_tokens, temperature, gen, eos_ids, gen_batch_size
    )
    for idx, answers, done in batches:
        for i, ans in zip(idx, answers, strict=True):
            if not ans or ans[-1] not in eos:
                continue
            body = ans[:-1]
            if len(body) < min_tokens:
                continue
            w = requests[i][0]
            prefix, suffix = wraps[w]
            out.append((w, [*prefix, *body, *suffix]))
        log(f"[variants] {done}/{len(requests)} requests, kept {len(out)}")
    return out


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Deterministic data order: epoch-wise permutations seeded by (seed, epoch)."""
    out: list[int] = []
    start = step * batch_size
    while len(out) < batch_size:
        epoch, off = divmod(start + len(out), n)
        perm = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(perm)
        out.extend(perm[off : off + batch_size - len(out)])
    return out


def sample_anchors(
    prompt_lens: Sequence[int], lengths: Sequence[int], nb: int, gen: torch.Generator
) -> Tensor:
    """Stratified random anchors in [prompt_len, len - 2] (each block has >= 1 target)."""
    rows = []
    for p, t in zip(prompt_lens, lengths, strict=True):
        span = max(t - 1 - p, 1)
        u = torch.rand(nb, generator=gen)
        a = p + ((torch.arange(nb) + u) * span / nb).long().clamp(max=span - 1)
        rows.append(a)
    return torch.stack(rows)
