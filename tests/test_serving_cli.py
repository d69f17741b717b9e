"""`dspark-obs bench` refuses bad input with one clear line, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dspark_obs.cli import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--url", "ftp://x"], "not an http(s) URL"),
        (["--url", "http://127.0.0.1:9", "--workload", "nope"], "unknown workload 'nope'"),
        (["--url", "http://127.0.0.1:9", "-n", "0"], "need at least one request"),
        (["--url", "http://127.0.0.1:9", "--input-len", "0"], "input_len and output_len"),
        (["--url", "http://127.0.0.1:9", "--timeout", "2"], "warm-up request"),
        (["--url", "http://127.0.0.1:9", "--warmup", "0", "--concurrency", "0"],
         "concurrency must be >= 1"),
    ],
)
def test_bench_bad_input_is_one_line(args, message, tmp_path):
    res = CliRunner().invoke(app, ["bench", *args, "--store", str(tmp_path / "s")])
    assert res.exit_code == 1
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "s").exists()  # nothing half-written
