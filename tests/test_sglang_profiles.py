"""Launch profiles against the rules in SGLang 0.5.23's own code (read from the wheel).

Every flag a profile emits must be a server argument the wheel declares
(``sglang/srt/arg_groups/fields/*.py``, field ``x_y`` = flag ``--x-y``), every environment
variable one its ``environ.py`` declares, the verify mode one of its ``RaggedVerifyMode``
values, the dump components ones its ``resolve_components`` accepts, and the STS rules of its
``DSparkVerifyPlanner.__init__`` (executed from the wheel's source with stubs: a fitted STS
with non-identity temperatures plus ``SGLANG_DSPARK_STS_COLLECT_PATH`` is a ValueError; the
STS gamma must be the runtime gamma) must pass.
"""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_wheel import PLANNER, Wheel, _pick

from dspark_obs.sglang.profiles import LaunchProfile, load_profiles, server_profiles

ROOT = Path(__file__).resolve().parents[1]
FIELDS = "sglang/srt/arg_groups/fields/"
ENVIRON = "sglang/srt/environ.py"
RAGGED = "sglang/srt/speculative/ragged_verify.py"


class _PastStsChecks(Exception):
    """Raised where the planner reads the verify mode: its STS checks all passed."""


@pytest.fixture(scope="module")
def rules(sglang_wheel: Wheel) -> dict[str, Any]:
    import zipfile

    with zipfile.ZipFile(sglang_wheel.path) as zf:
        names = [n for n in zf.namelist() if n.startswith(FIELDS) and n.endswith(".py")]
        flags = set()
        for n in names:
            for node in ast.walk(ast.parse(zf.read(n).decode())):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    flags.add("--" + node.target.id.replace("_", "-"))
        env_names = {
            t.id
            for node in ast.walk(ast.parse(zf.read(ENVIRON).decode()))
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name) and t.id.startswith("SGLANG_")
        }
        ragged = next(
            n
            for n in ast.parse(zf.read(RAGGED).decode()).body
            if isinstance(n, ast.ClassDef) and n.name == "RaggedVerifyMode"
        )
        modes = {s.value.value for s in ragged.body if isinstance(s, ast.Assign)}
    return {"flags": flags, "env": env_names, "modes": modes}


def _planner_init(wheel: Wheel, profile: LaunchProfile, gamma: int) -> None:
    """The wheel's DSparkVerifyPlanner.__init__ up to its verify-mode read, for a profile."""
    import torch

    argv = profile.argv
    sts = (
        argv[argv.index("--speculative-dspark-confidence-sts-path") + 1]
        if "--speculative-dspark-confidence-sts-path" in argv
        else None
    )
    env = profile.env

    class _Env:
        def __init__(self, v: Any) -> None:
            self.v = v

        def get(self) -> Any:
            return self.v

    def raise_past() -> None:
        raise _PastStsChecks

    ns: dict[str, Any] = {
        "torch": torch,
        "Optional": Any,
        "Union": Any,
        "logger": SimpleNamespace(info=lambda *a: None, warning=lambda *a: None),
        "get_spec": lambda: SimpleNamespace(
            speculative_dspark_confidence_sts_path=sts,
            speculative_dspark_align_verify_tokens_to_graph_tier=False,
        ),
        "envs": SimpleNamespace(
            SGLANG_DSPARK_STS_COLLECT_PATH=_Env(env.get("SGLANG_DSPARK_STS_COLLECT_PATH", ""))
        ),
        "load_sts_calibration_from_path": lambda path: SimpleNamespace(
            **json.loads(Path(path).read_text())
        ),
        "read_ragged_verify_mode": raise_past,
    }
    code = _pick(ast.parse(wheel.source(PLANNER)), ["DSparkVerifyPlanner"])
    exec(compile(ast.fix_missing_locations(code), f"<wheel>/{PLANNER}", "exec"), ns)
    head = SimpleNamespace(sts_temperatures=None)
    with pytest.raises(_PastStsChecks):
        ns["DSparkVerifyPlanner"](
            draft_model=SimpleNamespace(confidence_head=head),
            gamma=gamma,
            model_runner=None,
            device="cpu",
            tp_rank=1,
            verify_num_draft_tokens=gamma + 1,
            tp_sync=None,
        )


def _check(profile: LaunchProfile, rules: dict[str, Any]) -> None:
    flags = [a for a in profile.argv if a.startswith("--")]
    assert set(flags) <= rules["flags"], set(flags) - rules["flags"]
    assert set(profile.env) <= rules["env"], set(profile.env) - rules["env"]
    assert profile.env["SGLANG_RAGGED_VERIFY_MODE"] in rules["modes"]


def test_every_profile_combination_passes_the_wheels_rules(sglang_wheel, rules, tmp_path):
    fitted = tmp_path / "sts.json"
    for gamma, sps, sts in itertools.product((3, 5, 7), (None, "t.json"), (False, True)):
        if sts:
            fitted.write_text(json.dumps({"temperatures": [0.7 + 0.1 * i for i in range(gamma)]}))
        profiles = server_profiles(
            "m",
            "d",
            gamma=gamma,
            sps_table=sps,
            sts=str(fitted) if sts else None,
            out_dir=str(tmp_path),
        )
        for p in profiles:
            _check(p, rules)
            comps = sglang_wheel.obs["resolve_components"](
                tuple(p.env["SGLANG_DSPARK_DEBUG_DUMP"].split(","))
            )
            assert {c.value for c in comps} >= {"core", "reqs"}
            _planner_init(sglang_wheel, p, gamma)
        compact = profiles[0]
        assert ("SGLANG_DSPARK_STS_COLLECT_PATH" in compact.env) is (not sts)


def test_the_rule_itself_refuses_collection_under_a_fitted_sts(sglang_wheel, tmp_path):
    """The check above can fail: the old compact profile (both set) is what SGLang refuses."""
    fitted = tmp_path / "sts.json"
    fitted.write_text(json.dumps({"temperatures": [0.8] * 5}))
    (compact, _) = server_profiles("m", "d", sts=str(fitted), out_dir=str(tmp_path))
    both = LaunchProfile(
        compact.role,
        compact.url,
        compact.argv,
        {**compact.env, "SGLANG_DSPARK_STS_COLLECT_PATH": "x"},
    )
    with pytest.raises(ValueError, match="requires identity temperatures"):
        _planner_init(sglang_wheel, both, 5)
    with pytest.raises(ValueError, match="runtime gamma"):
        _planner_init(sglang_wheel, compact, 4)


def test_shipped_example_profiles_pass_the_wheels_rules(sglang_wheel, rules, tmp_path):
    for p in load_profiles(ROOT / "runtime" / "sglang" / "profiles.example.json"):
        _check(p, rules)
        sts_flag = "--speculative-dspark-confidence-sts-path"
        assert not (sts_flag in p.argv and "SGLANG_DSPARK_STS_COLLECT_PATH" in p.env)
