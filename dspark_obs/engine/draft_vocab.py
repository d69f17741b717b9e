"""A reduced draft vocabulary: the token ids drafting may propose, ranked by how often they
occur in the training distribution (see :meth:`Drafter.set_draft_vocab` for why it is
lossless). The ranking is stored once; any size N takes its first N ids, plus the stop ids
(a draft that cannot propose EOS could never be accepted at a request's end).

    python -m dspark_obs.engine.draft_vocab --out runtime/drafter/draft_vocab.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "runtime" / "drafter" / "draft_vocab.json"

CPU_DRAFT_VOCAB = 16384
"""The CPU's default size. There the full-vocabulary head at every block position costs about
a target step, and the top 16,384 ids drafted faster than the whole vocabulary in every
side-by-side run (README, "Engine throughput"); on a GPU the head is cheap and the whole
vocabulary accepts more, so drafting keeps it there."""


def default_draft_vocab(device: str) -> int:
    """The draft vocabulary size a run on ``device`` uses unless told (0: the whole one)."""
    return 0 if str(device).startswith("cuda") else CPU_DRAFT_VOCAB


def resolve_draft_vocab(n: int | None, device: str) -> int:
    """``n`` (None: the device's default), checked."""
    n = default_draft_vocab(device) if n is None else int(n)
    if n < 0:
        raise ValueError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {n}")
    return n


def rank_tokens(sequences: Iterable[Sequence[int]]) -> list[int]:
    """Token ids by falling frequency over ``sequences`` (ties: the lower id first)."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    return sorted(counts, key=lambda t: (-counts[t], t))


def draft_vocab(ranking: Sequence[int], n: int, always: Iterable[int] = ()) -> list[int]:
    """The first ``n`` ranked ids plus ``always`` (the stop ids), sorted."""
    if n < 1:
        raise ValueError(f"a draft vocabulary needs n >= 1, got {n}")
    return sorted({*map(int, ranking[:n]), *map(int, always)})


def shipped_draft_vocab(n: int, always: Iterable[int] = ()) -> list[int]:
    """:func:`draft_vocab` of the shipped ranking: what ``--draft-vocab N`` drafts from."""
    return draft_vocab(load_ranking(), n, always)


def save_ranking(path: str | Path, ranking: Sequence[int], source: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": source, "ranking": [int(t) for t in ranking]}) + "\n")
    return out


def load_ranking(path: str | Path = DEFAULT_PATH) -> list[int]:
    """The stored ranking; a clear error when the file is missing or malformed."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        ranking = [int(t) for t in data["ranking"]]
    except FileNotFoundError:
        raise ValueError(
            f"no draft vocabulary ranking at {p} (build it: python -m "
            "dspark_obs.engine.draft_vocab)"
        ) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{p}: not a draft vocabulary ranking ({exc})") from None
    if not ranking:
        raise ValueError(f"{p}: empty ranking")
    return ranking


def _training_sequences(tokenizer: object) -> Iterable[list[int]]:
    """Token ids of every train-split prompt (chat template applied) and its reference."""
    from dspark_obs.engine.weights import encode_chat
    from dspark_obs.workloads import WORKLOADS, load_prompts

    for workload in WORKLOADS:
        for prompt in load_prompts(workload, "train"):
            yield encode_chat(tokenizer, prompt.messages)
            if prompt.reference:
                yield list(tokenizer.encode(prompt.reference, add_special_tokens=False))  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_PATH))
    args = ap.parse_args(argv)
    from dspark_obs.engine.weights import load_smollm2

    _, tokenizer = load_smollm2()
    ranking = rank_tokens(_training_sequences(tokenizer))
    path = save_ranking(
        args.out,
        ranking,
        "SmolLM2 tokens of the train-split prompts and "
        "references of every workload (math, chat, poetry)",
    )
    print(f"{len(ranking)} distinct tokens ranked -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
