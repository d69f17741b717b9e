"""A CPU cost table belongs to the host it was profiled on: the profile records that host, a
table profiled ``--for-this-host`` is cached and wins over the shipped one on this host only
(same runtime and draft vocabulary), and a run on a shipped table of another host warns once.

The host is faked (``cpu_model``), the cache is a tmp directory (``$DSPARK_OBS_COST_TABLES``)
and the profile's timing is replaced by synthetic steps: nothing here times a real model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dspark_obs.cli import app
from dspark_obs.cost_table import AdditiveCostTable, CostTable, CostTableError
from dspark_obs.engine import host_tables, session
from dspark_obs.engine.host_tables import (
    ENV_TABLES,
    Host,
    host_table_dir,
    host_table_stem,
    this_host,
)
from dspark_obs.engine.profile_fit import StepSample
from dspark_obs.engine.session import load_cost_table, resolve_cost_table
from dspark_obs.testing.tiny_models import tiny_pair

FAKE_CPU = "Test CPU 9000"
SHIPPED_STEM = "smollm2_cpu_batched"  # the shipped table a batched CPU run falls back to


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty per-host table directory and a host whose CPU is :data:`FAKE_CPU`."""
    root = tmp_path / "tables"
    monkeypatch.setenv(ENV_TABLES, str(root))
    monkeypatch.setattr(host_tables, "cpu_model", lambda: FAKE_CPU)
    return root


def table(bias: float = 0.5, host: Host | None = None) -> AdditiveCostTable:
    data = {"bias_seconds": bias, "bs_probes": [1], "alpha_seconds": [0.0],
            "m_probes": [1, 8], "theta_seconds": [0.0, 0.1]}  # fmt: skip
    if host is not None:
        data["host"] = host.to_block()
    return AdditiveCostTable.from_dict(data)


def cache_table(host: Host, bias: float, name: str = SHIPPED_STEM) -> Path:
    """Put a table profiled on ``host`` where ``profile --for-this-host`` would."""
    path = host_table_dir() / f"{host_table_stem(name, host)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    table(bias, host).save(path)
    return path


def flat(output: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return " ".join(output.split())


def here(backend: str = "batched", draft_vocab: int = 16384) -> Host:
    return this_host("cpu", backend, draft_vocab)


# --------------------------------------------------------------------------- host block


def test_host_block_round_trips_and_old_tables_mean_an_unknown_host(tmp_path: Path) -> None:
    host = here()
    path = tmp_path / "t.json"
    table(host=host).save(path)
    loaded = CostTable.load(path)
    assert host_tables.table_host(loaded, path) == host
    assert json.loads(path.read_text())["host"]["cpu"] == host.cpu
    assert host_tables.table_host(table(), "old.json") is None  # no block: unknown host


def test_the_backend_is_matched_as_the_runtime_it_runs() -> None:
    assert this_host("cpu", "auto", 0).same_as(this_host("cpu", "batched", 0))
    assert not this_host("cpu", "reference", 0).same_as(this_host("cpu", "batched", 0))


def test_the_torch_version_is_recorded_but_not_matched() -> None:
    a = here()
    b = Host(**{**a.to_block(), "torch": "0.0.1"})
    assert a.same_as(b) and a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ("intel", "'host' must be an object"),
        ({"cpu": "x"}, "'host' lacks"),
        (
            {**Host("x", 2, 2, "cpu", "batched", 0).to_block(), "logical_cores": "2"},
            "host.logical_cores must be int",
        ),
    ],
)
def test_a_malformed_host_block_is_an_error_naming_the_file(
    tmp_path: Path, block: object, needle: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**table().to_dict(), "host": block}))
    with pytest.raises(CostTableError, match=rf"{path}.*{needle}"):
        resolve_cost_table(path, "cpu")


# --------------------------------------------------------------------------- resolution


def test_this_hosts_cached_table_wins_over_the_shipped_one(cache: Path) -> None:
    path = cache_table(here(), 0.25)
    choice = resolve_cost_table(None, "cpu", "auto")
    assert choice.origin == "host" and choice.path == path
    assert choice.table is not None and choice.table.to_dict()["bias_seconds"] == 0.25
    assert choice.profiled_here and choice.warning is None
    assert choice.summary() == f"cost table: {path} (profiled on this host)"


@pytest.mark.parametrize(
    "other",
    [
        {"cpu": "Another CPU"},
        {"logical_cores": 999},
        {"backend": "reference"},
        {"draft_vocab": 0},
    ],
)
def test_a_table_of_another_host_runtime_or_vocab_is_not_picked(
    cache: Path, other: dict[str, object]
) -> None:
    cache_table(Host(**{**here().to_block(), **other}), 0.25)
    choice = resolve_cost_table(None, "cpu", "auto")
    assert choice.origin == "shipped" and choice.path == session.DEFAULT_CPU_COST_TABLE
    assert choice.warning is not None


def test_the_reference_runtime_looks_for_its_own_table(cache: Path) -> None:
    path = cache_table(here("reference"), 0.75, name="smollm2_cpu")
    assert resolve_cost_table(None, "cpu", "reference").path == path
    assert resolve_cost_table(None, "cpu", "batched").origin == "shipped"


def test_the_shipped_table_of_another_host_warns_with_the_command(cache: Path) -> None:
    choice = resolve_cost_table(None, "cpu", "auto")
    assert choice.origin == "shipped" and choice.profiled_here is False
    warning = choice.warning
    assert warning is not None and "\n" not in warning
    assert "profiled on Intel(R) Xeon(R) Processor" in warning  # the shipped table says so
    assert f"this host is {FAKE_CPU}" in warning
    assert warning.endswith(
        "dspark-obs profile --device cpu --for-this-host --batch-sizes 1,2,4,8 --new-tokens 16"
    )
    assert "78 s" in warning
    assert "not this host" in choice.summary()


def test_the_suggested_command_profiles_the_runs_runtime_and_vocab(cache: Path) -> None:
    warning = resolve_cost_table(None, "cpu", "reference", 4096).warning
    assert warning is not None and "profiled on an unknown host" in warning  # no host block
    assert warning.endswith("--backend reference --draft-vocab 4096")


def test_no_warning_when_the_shipped_table_was_profiled_here(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = tmp_path / "shipped.json"
    table(host=here()).save(shipped)
    monkeypatch.setattr(session, "DEFAULT_CPU_COST_TABLE", shipped)
    choice = resolve_cost_table(None, "cpu")
    assert choice.origin == "shipped" and choice.profiled_here and choice.warning is None
    assert choice.summary() == f"cost table: {shipped} (shipped; profiled on this host)"


def test_an_explicit_table_wins_without_a_warning(cache: Path, tmp_path: Path) -> None:
    cache_table(here(), 0.25)
    mine = tmp_path / "mine.json"
    table(0.125, Host(**{**here().to_block(), "cpu": "Elsewhere"})).save(mine)
    choice = resolve_cost_table(mine, "cpu")
    assert choice.origin == "given" and choice.table.to_dict()["bias_seconds"] == 0.125
    assert choice.warning is None and choice.profiled_here is False
    assert choice.summary().startswith(f"cost table: {mine} (given; profiled on Elsewhere")


def test_gpu_defaults_never_read_the_cache_nor_warn(cache: Path) -> None:
    cache_table(Host(**{**here().to_block(), "device": "cuda"}), 0.25)
    choice = resolve_cost_table(None, "cuda")
    assert choice.origin in {"shipped", "none"} and choice.warning is None


def test_load_cost_table_logs_the_warning_once_and_only_when_due(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_cost_table(None, "cpu") is not None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("warning: the shipped CPU cost table")
    caplog.clear()
    cache_table(here(), 0.25)
    with caplog.at_level(logging.WARNING):
        assert load_cost_table(None, "cpu").to_dict()["bias_seconds"] == 0.25
    assert caplog.records == []


# --------------------------------------------------------------------------- broken cache


def test_a_malformed_cached_table_is_an_error_naming_the_file(cache: Path) -> None:
    path = cache_table(here(), 0.25)
    path.write_text('{"bias_seconds": ')
    with pytest.raises(CostTableError, match=rf"{path}.*this host's cached table; delete it"):
        resolve_cost_table(None, "cpu")


def test_a_cached_table_whose_host_block_is_not_this_host_is_an_error(cache: Path) -> None:
    path = cache_table(here(), 0.25)
    table(0.25, Host(**{**here().to_block(), "cpu": "Copied"})).save(path)  # renamed onto ours
    with pytest.raises(CostTableError, match=rf"{path}.*profiled on Copied .*not on this host"):
        resolve_cost_table(None, "cpu")


def test_run_refuses_a_malformed_cached_table_before_any_work(cache: Path, tmp_path: Path) -> None:
    path = cache_table(here(), 0.25)
    path.write_text("not json")
    store = tmp_path / "store"
    res = CliRunner().invoke(app, ["run", "--store", str(store), "-n", "1"])
    assert res.exit_code == 2
    assert str(path) in "".join(res.output.split()) and "cached table" in flat(res.output)
    assert not store.exists()


def test_run_with_an_explicit_table_never_reads_the_cache(cache: Path, tmp_path: Path) -> None:
    cache_table(here(), 0.25).write_text("not json")
    mine = tmp_path / "mine.json"
    table().save(mine)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")  # refused after the table is resolved, before the model loads
    args = ["run", "--store", str(tmp_path / "store"), "--workload-file", str(empty)]
    res = CliRunner().invoke(app, [*args, "--cost-table", str(mine)])
    assert res.exit_code == 2 and "no requests" in flat(res.output)
    assert "warning" not in res.output and "cached table" not in flat(res.output)
    res = CliRunner().invoke(app, args)  # without it, the broken cached table is refused
    assert res.exit_code == 2 and "cached table" in flat(res.output)


@pytest.mark.parametrize(("mode", "warns"), [("compact", True), ("cap-accept", True),
                                             ("static", False)])  # fmt: skip
def test_run_warns_once_when_its_mode_plans_windows(
    cache: Path, tmp_path: Path, mode: str, warns: bool
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")  # refused after the warning, before the model loads
    args = ["run", "--store", str(tmp_path / "store"), "--workload-file", str(empty)]
    res = CliRunner().invoke(app, [*args, "--mode", mode])
    assert res.exit_code == 2 and "no requests" in flat(res.output)
    assert res.output.count("warning: the shipped CPU cost table") == int(warns)


# --------------------------------------------------------------------------- profile CLI


@pytest.fixture
def fake_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dspark-obs profile`` on a tiny random model with synthetic step times."""
    from dspark_obs import workloads
    from dspark_obs.engine import profile, weights

    target, _ = tiny_pair(double=False)
    monkeypatch.setattr(weights, "load_smollm2", lambda device, dtype: (target, None))
    monkeypatch.setattr(weights, "encode_chat", lambda tok, messages: [1, 2, 3])
    monkeypatch.setattr(workloads, "load_prompts", lambda *a, **k: [])

    def steps(*args: object, batch_sizes: list[int], fractions: list[float], **kw: object):
        return [
            StepSample(bs, frac, int(frac * bs * 5), 0.02 + 0.003 * bs + 0.001 * frac * bs * 5)
            for bs in batch_sizes
            for frac in fractions
            for _ in range(4)
        ]

    monkeypatch.setattr(profile, "profile_steps", steps)


PROFILE = ["profile", "--batch-sizes", "1,2,4", "--fractions", "0,0.5,1", "--new-tokens", "4"]


def test_profile_writes_the_host_into_both_tables_and_the_report(
    cache: Path, fake_profile: None, tmp_path: Path
) -> None:
    args = [*PROFILE, "--drafter", str(tmp_path / "none"), "--draft-vocab", "0"]
    res = CliRunner().invoke(app, [*args, "--out-dir", str(tmp_path / "out"), "--name", "t"])
    assert res.exit_code == 0, res.output
    want = here(draft_vocab=0).to_block()
    for name in ("t.json", "t_1d.json", "t_fit.json"):
        assert json.loads((tmp_path / "out" / name).read_text())["host"] == want
    assert not cache.exists()  # an --out-dir profile leaves the host cache alone


def test_profile_for_this_host_is_what_a_run_here_then_plans_with(
    cache: Path, fake_profile: None, tmp_path: Path
) -> None:
    args = [*PROFILE, "--drafter", str(tmp_path / "none"), "--draft-vocab", "0"]
    res = CliRunner().invoke(app, [*args, "--for-this-host"])
    assert res.exit_code == 0, res.output
    host = here(draft_vocab=0)
    path = cache / f"{SHIPPED_STEM}-{host.fingerprint()}.json"
    assert res.stdout.splitlines()[0] == str(path)
    report = json.loads(path.with_name(path.stem + "_fit.json").read_text())
    assert "--for-this-host" in report["command"] and "--out-dir" not in report["command"]
    choice = resolve_cost_table(None, "cpu", "auto", 0)
    assert choice.origin == "host" and choice.path == path and choice.warning is None
    assert resolve_cost_table(None, "cpu", "auto").origin == "shipped"  # another draft vocab


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--device", "cuda"], "--for-this-host is for --device cpu"),
        (["--out-dir", "x"], "drop --out-dir / --name"),
        (["--name", "x"], "drop --out-dir / --name"),
    ],
)
def test_profile_for_this_host_refuses_what_it_cannot_honour(
    cache: Path, tmp_path: Path, extra: list[str], needle: str
) -> None:
    res = CliRunner().invoke(app, ["profile", "--for-this-host", *extra])
    assert res.exit_code == 2 and needle in " ".join(res.output.split())
    assert not cache.exists()
