"""common/ is imported by every process, the gateway included: importing it never loads torch, and
its modules import one another one way only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

COMMON = Path(__file__).resolve().parent.parent / "common"


def test_importing_every_common_module_loads_no_torch():
    code = (
        "import importlib, pkgutil, sys, common\n"
        "for m in pkgutil.iter_modules(common.__path__): importlib.import_module('common.' + m.name)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'programs')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=COMMON.parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _imports(path: Path) -> set[str]:
    """The common modules `path` imports anywhere (at module level or inside a function)."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            deps |= {f"common.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.startswith("common.")}
    return deps


def test_common_modules_import_each_other_without_a_circle():
    graph = {f"common.{p.stem}": _imports(p) for p in COMMON.glob("*.py")}
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        for dep in sorted(graph.get(mod, ())):
            assert dep not in path, " → ".join([*path[path.index(dep) :], dep])
            if dep not in done:
                visit(dep, [*path, dep])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [mod])
