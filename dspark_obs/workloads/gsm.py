"""The ``math`` workload: GSM8K-style problems from reasoning-gym's gsm_symbolic templates.

reasoning-gym ships 100 symbolic GSM8K templates as stdlib-only functions
``generate_<k>(rng, difficulty)`` in ``reasoning_gym/arithmetic/gsm_symbolic/generators_*.py``.
Their only project import is ``reasoning_gym.utils`` (stdlib-only too). Both files are
executed here in private namespaces, with that one import redirected to a private copy of
``utils``; the package ``reasoning_gym/__init__`` (heavy optional deps) never runs.

Split rule: by template. Templates the package marks usable (``tasks_ok``, read with
:mod:`ast`) are ordered by a stable hash of their id and the first ``EVAL_FRACTION`` of them
are eval-only, so one template never appears on both sides with other numbers.
Each template contributes ``INSTANCES_PER_TEMPLATE`` seeded instances (instance ``i`` of
template ``k`` uses ``Random(derive_seed("gsm_symbolic", k, i))``); instances whose answer
is not an integer and exact repeats of a question are dropped.
"""

from __future__ import annotations

import ast
import builtins
import functools
import random
import types
from collections.abc import Callable
from typing import Any

from dspark_obs.workloads.base import (
    EVAL_FRACTION,
    Prompt,
    derive_seed,
    normalize_text,
    stable_hash,
)
from dspark_obs.workloads.sources import package_files

__all__ = [
    "INSTANCES_PER_TEMPLATE",
    "INSTRUCTION",
    "generate",
    "pool",
    "template_ids",
    "template_split",
]

PACKAGE = "reasoning-gym"
_GEN_DIR = "reasoning_gym/arithmetic/gsm_symbolic/"
_GEN_FILES = ("generators_00_49.py", "generators_50_99.py")
INSTANCES_PER_TEMPLATE = 200
DIFFICULTY = 1.0  # the only difficulty gsm_symbolic supports
INSTRUCTION = (
    "Solve the following math problem step by step. "
    "End with a final line of the form 'Answer: <number>'."
)

Generator = Callable[[random.Random, float], dict[str, Any]]


def _sandbox_builtins(utils: types.ModuleType) -> dict[str, Any]:
    """Builtins whose ``__import__`` serves ``reasoning_gym.utils`` from ``utils``."""
    real_import = builtins.__import__

    def _import(name: str, globals_=None, locals_=None, fromlist=(), level=0):  # type: ignore[no-untyped-def]
        if level == 0 and name == "reasoning_gym.utils":
            return utils
        if level == 0 and name.split(".")[0] == "reasoning_gym":
            raise ImportError(f"{name} is not available to the sandboxed gsm_symbolic generators")
        return real_import(name, globals_, locals_, fromlist, level)

    sandbox = dict(vars(builtins))
    sandbox["__import__"] = _import
    return sandbox


@functools.cache
def generators() -> dict[int, Generator]:
    """All ``generate_<k>`` functions of the pinned reasoning-gym, by template id."""
    files = package_files(PACKAGE)
    utils = types.ModuleType("_dspark_obs_reasoning_gym_utils")
    utils.__file__ = "reasoning_gym/utils.py"
    exec(compile(files.read_text("reasoning_gym/utils.py"), utils.__file__, "exec"), vars(utils))
    sandbox = _sandbox_builtins(utils)
    found: dict[int, Generator] = {}
    for name in _GEN_FILES:
        member = _GEN_DIR + name
        namespace: dict[str, Any] = {
            "__builtins__": sandbox,
            "__name__": "_dspark_obs_gsm_" + name.removesuffix(".py"),
        }
        exec(compile(files.read_text(member), member, "exec"), namespace)
        for key, value in namespace.items():
            if key.startswith("generate_") and key[9:].isdigit() and callable(value):
                found[int(key[9:])] = value
    if not found:
        raise RuntimeError(f"no gsm_symbolic generators found in {files}")
    return found


@functools.cache
def template_ids() -> tuple[int, ...]:
    """Template ids reasoning-gym marks as working (``tasks_ok``), sorted."""
    source = package_files(PACKAGE).read_text(_GEN_DIR + "gsm_symbolic.py")
    for node in ast.parse(source).body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "tasks_ok"
        ):
            ids = ast.literal_eval(node.value)
            available = generators()
            return tuple(sorted(int(i) for i in ids if int(i) in available))
    raise RuntimeError("tasks_ok not found in gsm_symbolic.py")


@functools.cache
def _eval_templates() -> frozenset[int]:
    ids = sorted(template_ids(), key=lambda t: stable_hash(f"gsm_symbolic-template:{t}"))
    return frozenset(ids[: round(EVAL_FRACTION * len(ids))])


def template_split(template: int) -> str:
    """The split a template belongs to (every instance of it follows)."""
    if template not in template_ids():
        raise ValueError(f"unknown or unusable gsm_symbolic template {template}")
    return "eval" if template in _eval_templates() else "train"


def generate(template: int, index: int) -> dict[str, Any] | None:
    """Instance ``index`` of ``template``: question, integer answer and worked solution.

    None when the generator's answer is not an integer.
    """
    rng = random.Random(derive_seed("gsm_symbolic", template, index))
    example = generators()[template](rng, DIFFICULTY)
    value = float(example["answer"])
    if not value.is_integer():
        return None
    meta = example.get("metadata", {})
    return {
        "question": str(example["question"]).strip(),
        "answer": int(value),
        "answer_cot": str(meta.get("answer_cot", "")),
    }


@functools.cache
def pool(split: str) -> tuple[Prompt, ...]:
    """Every math prompt of ``split``, in a fixed order."""
    out: list[Prompt] = []
    seen: set[str] = set()
    for template in template_ids():
        if template_split(template) != split:
            continue
        for index in range(INSTANCES_PER_TEMPLATE):
            example = generate(template, index)
            if example is None:
                continue
            key = normalize_text(example["question"])
            if key in seen:
                continue
            seen.add(key)
            out.append(
                Prompt(
                    id=f"math-t{template:02d}-{index:03d}",
                    workload="math",
                    messages=[
                        {"role": "user", "content": f"{INSTRUCTION}\n\n{example['question']}"}
                    ],
                    reference=str(example["answer"]),
                    meta={
                        "source": f"{PACKAGE}=={package_files(PACKAGE).pin.version}",
                        "template": template,
                        "index": index,
                        "answer_cot": example["answer_cot"],
                    },
                )
            )
    return tuple(out)
