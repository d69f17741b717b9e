"""Shared fixtures: SGLang 0.5.23's own code from the wheel (see tests/sglang_wheel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from sglang_wheel import WHEELS, Wheel, find_wheel  # noqa: E402


@pytest.fixture(scope="session")
def sglang_wheel() -> Wheel:
    """The wheel's DSpark dumper, estimator recorder, startup-time builder and /server_info
    handler, loaded from its source; skips (with the reason) only when the wheel is absent."""
    path = find_wheel()
    if path is None:
        pytest.skip(f"sglang 0.5.23 wheel not in {WHEELS} (.ci/run downloads it)")
    return Wheel.load(path)
