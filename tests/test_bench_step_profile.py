"""The step-profiling benches wrap engine methods by name: every name must still exist, or the
GPU run that needs it dies after its compile (it did once, on a method that a refactor had
renamed)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from dspark_obs.engine.step import StepPipeline

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_method_the_profile_timeline_times_exists() -> None:
    timed = _bench("bench_step_profile").TIMED
    assert timed
    for module, owner, name in timed:
        mod = importlib.import_module(module)
        target = mod if owner is None else getattr(mod, owner)
        assert callable(getattr(target, name, None)), f"{module}.{owner}.{name} is gone"


def test_every_pipeline_part_the_breakdown_times_exists() -> None:
    for name in _bench("bench_step_breakdown").PIPELINE:
        assert callable(getattr(StepPipeline, name, None)), f"StepPipeline.{name} is gone"
