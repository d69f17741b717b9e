"""SGLang's STS collection shards: ``stem.N.pt`` = torch.save({"logits": [n, gamma],
"prefix_mask": [n, gamma] = 1[k < correct_drafts]}), read and written.

Read with ``weights_only`` and a size cap, every field checked, so a shard from outside is
either data or one :class:`~dspark_obs.sts_file.StsFileError` naming the file and the problem.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence

import numpy as np

from dspark_obs.analytics.sts import StsData
from dspark_obs.sts_file import MAX_GAMMA, StsFileError

MAX_SHARD_BYTES = 4 * 2**30
"""Largest shard file loaded (4 GiB: ~150M rows at gamma 7)."""


def load_sts_shards(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> StsData:
    """Read SGLang collection shards (a glob or a list of paths), concatenated in sorted order."""

    if isinstance(paths, str | os.PathLike):
        files = sorted(glob.glob(str(paths)))
        if not files:
            raise StsFileError(f"{paths}: no STS shard matched")
    else:
        files = [str(p) for p in paths]
        if not files:
            raise StsFileError("no STS shard given")
    logits, masks, gamma = [], [], None
    for f in files:
        lg, pm = _read_shard(f)
        if gamma is None:
            gamma = lg.shape[1]
        elif lg.shape[1] != gamma:
            raise StsFileError(
                f"{f}: gamma {lg.shape[1]} disagrees with earlier shards' gamma {gamma}"
            )
        logits.append(lg)
        masks.append(pm)
    lg = np.concatenate(logits)
    pm = np.concatenate(masks)
    return StsData(lg, pm, np.ones(lg.shape, dtype=bool))


def _read_shard(f: str) -> tuple[np.ndarray, np.ndarray]:
    """One shard's (logits, prefix_mask) as float64 [n, gamma], validated field by field."""
    import torch

    try:
        size = os.path.getsize(f)
    except OSError as exc:
        raise StsFileError(f"{f}: cannot read ({exc.strerror or exc})") from None
    if size > MAX_SHARD_BYTES:
        raise StsFileError(f"{f}: {size} bytes, above the {MAX_SHARD_BYTES // 2**30} GiB cap")
    try:  # weights_only: a shard from outside must not run code while unpickling
        shard = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; name the file
        raise StsFileError(f"{f}: cannot load shard ({type(exc).__name__}: {exc})"[:500]) from None
    if not isinstance(shard, Mapping) or "logits" not in shard or "prefix_mask" not in shard:
        raise StsFileError(f"{f}: expected a dict with 'logits' and 'prefix_mask'")
    out = []
    for name in ("logits", "prefix_mask"):
        t = shard[name]
        if not isinstance(t, torch.Tensor):
            raise StsFileError(f"{f}: '{name}' must be a tensor, got {type(t).__name__}")
        if t.is_complex() or t.is_quantized or t.is_meta or t.layout != torch.strided:
            raise StsFileError(f"{f}: '{name}' has unusable dtype {t.dtype}")
        if t.ndim != 2 or not 1 <= t.shape[1] <= MAX_GAMMA:
            raise StsFileError(
                f"{f}: '{name}' must be [n, gamma] with gamma in 1..{MAX_GAMMA}, "
                f"got shape {tuple(t.shape)}"
            )
        out.append(t.detach().cpu().to(torch.float64).numpy())
    lg, pm = out
    if lg.shape != pm.shape:
        raise StsFileError(
            f"{f}: logits {lg.shape} / prefix_mask {pm.shape} must be equal [n, gamma]"
        )
    bad = ~np.isfinite(lg)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise StsFileError(
            f"{f}: 'logits' row {row} position {col} is {lg[row, col]}; "
            f"{int(bad.sum())} non-finite value(s)"
        )
    bad = (pm != 0) & (pm != 1)
    if bad.any():
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise StsFileError(
            f"{f}: 'prefix_mask' row {row} position {col} is {pm[row, col]}; "
            f"every value must be 0 or 1 ({int(bad.sum())} bad)"
        )
    return lg, pm


def save_sts_shard(
    path: str | os.PathLike[str], conf_logits: np.ndarray, prefix_mask: np.ndarray
) -> None:
    """Write one shard in SGLang's format (float32 tensors), e.g. from the embedded engine."""
    import torch

    torch.save(
        {
            "logits": torch.as_tensor(np.asarray(conf_logits), dtype=torch.float32),
            "prefix_mask": torch.as_tensor(np.asarray(prefix_mask), dtype=torch.float32),
        },
        str(path),
    )
