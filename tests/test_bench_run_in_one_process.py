"""bench/run_in_one_process.py: segments run in order in one interpreter, which is what lets a
later bench reuse what an earlier one compiled; a failing segment stops none after it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("run_in_one_process", ROOT / "bench" /
                                                  "run_in_one_process.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_segments_share_the_process_and_a_failure_stops_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shared_state.py").write_text("calls = []\n")
    script = tmp_path / "step.py"
    script.write_text(
        "import sys\n"
        "import shared_state\n"  # found next to the script, as `python step.py` finds it
        "shared_state.calls.append(sys.argv[1:])\n"
        "print('calls so far', len(shared_state.calls))\n"
        "if sys.argv[1:] == ['fail']:\n"
        "    raise SystemExit(3)\n"
    )
    monkeypatch.delitem(sys.modules, "shared_state", raising=False)
    rc = _runner().main(["--", str(script), "a", "--", str(script), "fail", "--", str(script)])
    out, err = capsys.readouterr()
    assert rc == 3  # the first non-zero status
    assert [line for line in out.splitlines() if line.startswith("calls")] == [
        "calls so far 1", "calls so far 2", "calls so far 3",  # one module, imported once
    ]  # fmt: skip
    assert [line.split()[1] for line in err.splitlines() if line.startswith("rc ")] == [
        "0", "3", "0",
    ]  # fmt: skip
    assert str(tmp_path) not in sys.path  # each segment's path is undone


def test_the_cli_runs_as_a_segment(capsys: pytest.CaptureFixture[str]) -> None:
    assert _runner().main(["--", "dspark-obs", "--help"]) == 0
    assert "profile" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        ([], "segments start with '--'"),
        (["bench/bench_overlap.py"], "segments start with '--'"),
        (["--", "--", "x"], "segment 1 is empty"),
        (["--", "no/such/script.py"], "no script at 'no/such/script.py'"),
    ],
)
def test_bad_segments_are_named(
    argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _runner().main(argv) == 2
    assert problem in capsys.readouterr().err
