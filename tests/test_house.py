"""The house's import rules, checked on the source: no import circles, no import upward.

Parsed with ``ast`` (nothing is imported), so a violation is found even in a function-level
import that no test happens to execute. The layer order is written once here and in
docs/house.md (keep the two equal).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "dspark_obs"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Bottom to top: a module may import its own layer and the layers below it, never above.
# (docs/house.md explains each layer; a module not named here takes its package's layer.)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_atomic", "_jsonfile", "schema", "rules", "validation", "cost_table", "sts_file"),
    ("workloads",),
    ("analytics",),
    ("fanout",),
    ("engine",),
    ("store",),
    ("sinks",),
    ("serving",),
    ("sglang",),
    ("testing",),
    ("cli", "__main__"),
)

# Edges forbidden whatever the layers say (DESIGN.md): producers never import sinks, sinks
# never import the engine. (A producer is the embedded engine or the SGLang collector.)
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("engine", "sinks", "producers never import sinks"),
    ("sglang", "sinks", "producers never import sinks"),
    ("sinks", "engine", "sinks never import the engine"),
)

# Known violations that are being fixed; each entry names who removes it. MUST SHRINK TO
# EMPTY: an entry that no longer matches a real edge fails the test, so it cannot linger.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(importer: str, path: Path, mods: set[str]) -> Iterator[tuple[str, int]]:
    """Every project module an import statement anywhere in the file (module level, function
    level, under ``if TYPE_CHECKING``) names, with its line. ``from a import b`` names ``a.b``
    when b is a module, else ``a`` (b comes from a's ``__init__``). Strings passed to
    ``import_module`` count too (a literal, or an f-string's literal prefix)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in mods else base), node.lineno
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            target = _literal_prefix(node.args[0])
            if target:
                yield target, node.lineno


def _is_import_module(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "import_module"


def _literal_prefix(arg: ast.expr) -> str:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".")
    return ""


@functools.cache
def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported project module: first line}. Importing ``a.b.c`` also runs the
    ``__init__`` of every package above it that is not the importer's own (``a.b``), so
    those count as imported too: an eager re-export in a package's ``__init__`` is an edge.
    A name taken from one's own package (``from a.b import name`` inside ``a.b.c``) is an
    edge to that ``__init__``."""
    mods = modules(root)
    names = set(mods)
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        edges: dict[str, int] = {}
        for target, line in imported_modules(name, path, names):
            parts = target.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            known = [p for p in prefixes if p in names]
            if not known or parts[0] != PACKAGE:
                continue
            named = known[-1]  # the module the statement asks for
            for prefix in known:
                if prefix != name and (prefix == named or prefix not in own):
                    edges.setdefault(prefix, line)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """Strongly connected components of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def area(module: str) -> str:
    """The first name under the package: ``dspark_obs.engine.loop`` -> ``engine``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if area(module) in names:
            return rank
    raise KeyError(module)


def _has_layer(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return False
    return True


def upward_edges(graph: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> why it is refused, for every edge against the house rules."""
    bad: dict[tuple[str, str], str] = {}
    for src, targets in graph.items():
        if not _has_layer(src):
            continue  # test_every_module_has_a_layer names it
        for dst in targets:
            if not _has_layer(dst):
                continue
            if layer_of(dst) > layer_of(src):
                bad[(src, dst)] = f"{area(src)} is below {area(dst)}"
            for low_area, high_area, why in FORBIDDEN:
                if area(src) == low_area and area(dst) == high_area:
                    bad[(src, dst)] = why
    return bad


def _where(graph: dict[str, dict[str, int]], src: str, dst: str) -> str:
    return f"{src} -> {dst} (line {graph[src][dst]})"


# ------------------------------------------------------------------------------ the rules


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in modules() if m != PACKAGE and not _has_layer(m))
    assert not missing, f"add these areas to LAYERS (and docs/house.md): {missing}"


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    new = [c for c in found if c not in KNOWN_CIRCLES]
    detail = [sorted(_where(graph, a, b) for a in c for b in graph[a] if b in c) for c in new]
    assert not new, f"import circles: {detail}"


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    graph = import_graph()
    bad = upward_edges(graph)
    new = {edge: why for edge, why in bad.items() if edge not in KNOWN_UPWARD}
    lines = sorted(f"{_where(graph, *edge)}: {why}" for edge, why in new.items())
    assert not new, "imports against the layers:\n" + "\n".join(lines)


def test_the_allow_lists_hold_only_live_violations() -> None:
    """An entry whose violation was fixed must be removed, so the lists shrink to empty."""
    graph = import_graph()
    stale_circles = set(KNOWN_CIRCLES) - set(circles(graph))
    stale_upward = set(KNOWN_UPWARD) - set(upward_edges(graph))
    assert not stale_circles and not stale_upward, (
        f"fixed, remove from the allow-list: {sorted(map(sorted, stale_circles))} "
        f"{sorted(stale_upward)}"
    )


def test_layers_are_written_the_same_in_docs_house_md() -> None:
    doc = (ROOT.parent / "docs" / "house.md").read_text()
    for rank, names in enumerate(LAYERS):
        row = f"| {rank} | " + ", ".join(f"`{n}`" for n in names) + " |"
        assert row in doc, f"docs/house.md lacks the layer row {row!r}"


def _public_api(tree: ast.Module) -> tuple[list[str] | None, set[str]]:
    """(``__all__``'s names or None, the names the module binds at top level)."""
    exported: list[str] | None = None
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            bound |= names
            if "__all__" in names and isinstance(node.value, ast.List | ast.Tuple):
                exported = [ast.literal_eval(e) for e in node.value.elts]
    return exported, bound


def test_every_package_init_shows_its_public_api() -> None:
    """One ``__init__`` style: a docstring, then eager imports of what ``__all__`` lists (no
    lazy ``__getattr__``); a package whose modules must stay importable without torch says
    why in its docstring and exports nothing."""
    problems = []
    for path in sorted(ROOT.rglob("__init__.py")):
        tree = ast.parse(path.read_text())
        exported, bound = _public_api(tree)
        where = path.relative_to(ROOT.parent)
        if not ast.get_docstring(tree):
            problems.append(f"{where}: no docstring")
        if exported is None:
            problems.append(f"{where}: no __all__")
        elif set(exported) - bound:
            problems.append(f"{where}: __all__ names unbound {sorted(set(exported) - bound)}")
        if "__getattr__" in bound:
            problems.append(f"{where}: lazy __getattr__ (import the public names eagerly)")
    assert not problems, problems


# ------------------------------------------------------------------ the checker itself


def _graph_of(sources: dict[str, str], tmp_path: Path) -> dict[str, dict[str, int]]:
    for rel, text in sources.items():
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path / PACKAGE)


def test_the_checker_sees_function_level_relative_and_importlib_imports(tmp_path: Path) -> None:
    graph = _graph_of(
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/loop.py": "def f():\n    from . import batched\n",
            "engine/batched.py": "from dspark_obs.engine.loop import f\n",
            "sinks/__init__.py": "from dspark_obs.sinks.otel import X\n",
            "sinks/otel.py": "import importlib\nimportlib.import_module('dspark_obs.engine.loop')",
            "schema.py": "def g():\n    from dspark_obs.sinks import otel\n",
            "store/__init__.py": "from dspark_obs.store.store import Store\n",
            "store/store.py": "from dspark_obs.store.layout import Layout\n",
            "store/layout.py": "from dspark_obs.store import StoreError\n",
        },
        tmp_path,
    )
    assert sorted(map(sorted, circles(graph))) == [
        ["dspark_obs.engine.batched", "dspark_obs.engine.loop"],
        # a name taken from one's own package's __init__, which imports the module back
        ["dspark_obs.store", "dspark_obs.store.layout", "dspark_obs.store.store"],
    ]
    bad = upward_edges(graph)
    assert bad[("dspark_obs.schema", "dspark_obs.sinks")] == "schema is below sinks"
    assert bad[("dspark_obs.schema", "dspark_obs.sinks.otel")] == "schema is below sinks"
    assert bad[("dspark_obs.sinks.otel", "dspark_obs.engine.loop")] == (
        "sinks never import the engine"
    )
    # importing a package's module runs that package's __init__ (an edge), not one's own
    assert "dspark_obs.engine" in graph["dspark_obs.sinks.otel"]
    assert "dspark_obs.engine" not in graph["dspark_obs.engine.batched"]


@pytest.mark.parametrize("cycle_len", [2, 3])
def test_the_checker_finds_a_circle_of_any_length(tmp_path: Path, cycle_len: int) -> None:
    names = [f"m{i}" for i in range(cycle_len)]
    sources = {"__init__.py": ""}
    for i, name in enumerate(names):
        sources[f"{name}.py"] = f"import dspark_obs.{names[(i + 1) % cycle_len]}\n"
    found = circles(_graph_of(sources, tmp_path))
    assert found == [frozenset(f"dspark_obs.{n}" for n in names)]
