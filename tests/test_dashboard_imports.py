"""The Streamlit app's modules import each other as a package (``dashboards.streamlit.*``),
never by a bare module name that only resolves because Streamlit puts the script's folder on
``sys.path`` (where a ``ui`` or ``queries`` of someone else's would shadow, or be shadowed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboards" / "streamlit"


def _app_files() -> list[Path]:
    return sorted(p for p in APP.rglob("*.py") if "__pycache__" not in p.parts)


def _local_names() -> set[str]:
    """Names a bare import of the app's own modules would use: its files and folders."""
    names = {p.stem for p in APP.glob("*.py")} | {p.name for p in APP.iterdir() if p.is_dir()}
    return names - {"__pycache__"}


def test_the_app_imports_its_modules_by_their_package_name() -> None:
    local = _local_names()
    assert {"ui", "queries", "rollups"} <= local
    bare = []
    for path in _app_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: pages run as scripts, where it cannot work
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno} relative import")
                    continue
                names = [(node.module or "").split(".")[0]]
            else:
                continue
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n in local]
    assert not bare, f"bare imports of the app's own modules: {bare}"


def test_every_page_module_imports_outside_streamlit(tmp_path: Path) -> None:
    """The query modules import from any directory with only the repository root on the
    path: no page's numbers depend on where Streamlit was started."""
    modules = [
        "dashboards.streamlit.queries." + p.stem
        for p in sorted((APP / "queries").glob("*.py"))
        if p.stem != "__init__"
    ]
    assert len(modules) >= 8  # shared + one per page
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = subprocess.run(
        [sys.executable, "-c", code, *modules, "dashboards.streamlit.ui"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
