"""Step time against verify budget on the GPU without the real weights (they do not change
step time): a SmolLM2-135M-shaped random target with the shipped drafter, bf16, CUDA graphs,
torch.compile, compact steps pinned at budget fractions 0 / 0.5 / 1 of bs * gamma.

Checks that fewer verified tokens are not slower (the inversion an earlier profile showed,
when censored windows cost per-request host work). Needs no GGUF, so it fits a short lease:

    python bench/bench_profile_recheck.py [--batch 16,64] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from dspark_obs.engine.drafter import Drafter
from dspark_obs.engine.model import ModelConfig, Target
from dspark_obs.engine.profile import profile_steps
from dspark_obs.engine.session import DEFAULT_DRAFTER


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="16,64")
    ap.add_argument("--new-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = Target(ModelConfig.smollm2_135m()).to("cuda", torch.bfloat16).eval()
    drafter = Drafter.load(DEFAULT_DRAFTER, target, device="cuda").to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (120 + 10 * i,), generator=gen).tolist() for i in range(8)]
    t0 = time.time()
    profile_steps(
        target, drafter, prompts,
        batch_sizes=tuple(int(b) for b in args.batch.split(",")),
        fractions=(0, 0.5, 1), new_tokens=args.new_tokens, compile=True,
        progress=lambda line: print(f"[{time.time() - t0:5.1f}s] {line}", flush=True),
    )


if __name__ == "__main__":
    main()
