"""The layering the code keeps: runtime packages never name a model, a model never imports
another model, the gateway never loads torch or `programs`, `common` loads no torch when imported,
and the gateway's modules import each other one way."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import programs

REPO = Path(__file__).resolve().parents[1]
RUNTIME = ("gateway", "tokenizer_worker", "gpu_worker", "codec_worker", "common")


def _py_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions and TYPE_CHECKING blocks."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _model_word_pattern() -> re.Pattern[str]:
    # A word not glued to letters before it, nor to lower-case letters after it: "CsmProgram" and
    # "orpheus-tiny" match, "mimic" and "snack" do not.
    words = sorted(programs.model_words(), key=len, reverse=True)
    return re.compile(r"(?<![A-Za-z])(?i:" + "|".join(map(re.escape, words)) + r")(?![a-z])")


@pytest.mark.parametrize("package", RUNTIME)
def test_runtime_code_outside_programs_names_no_model(package: str) -> None:
    pattern = _model_word_pattern()
    hits = [
        f"{path.relative_to(REPO)}:{i}: {line.strip()}"
        for path in _py_files(package)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, "model names in runtime code (move them into the model's program):\n" + "\n".join(hits)


def test_the_list_of_model_words_grows_with_the_registry() -> None:
    words = programs.model_words()
    packages = {p.parent.name for p in (REPO / "programs").glob("*/spec.py")}
    assert packages and packages <= words  # every model folder, whatever models come
    assert "blocks" not in words


def test_a_model_folder_imports_no_other_model() -> None:
    models = {p.parent.name for p in (REPO / "programs").glob("*/spec.py")}
    bad = []
    for model in sorted(models):
        for path in sorted((REPO / "programs" / model).rglob("*.py")):
            for name in _imports(path):
                parts = name.split(".")
                if parts[0] == "programs" and len(parts) > 1 and parts[1] in models - {model}:
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "share code through programs/blocks instead:\n" + "\n".join(bad)


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_gateway_imports_neither_torch_nor_programs() -> None:
    loaded = _loaded_after_import([_module(p) for p in _py_files("gateway")])
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "programs")}


def test_common_imports_no_torch_at_module_level() -> None:
    offenders = [
        _module(p)
        for p in _py_files("common")
        if "torch" in {m.split(".")[0] for m in _loaded_after_import([_module(p)])}
    ]
    assert not offenders, f"import torch inside the functions that need it: {offenders}"


def test_the_gateways_modules_import_each_other_one_way() -> None:
    graph = {
        _module(p): {m for m in _imports(p) if m.startswith("gateway.")}
        & {_module(q) for q in _py_files("gateway")}
        for p in _py_files("gateway")
        if p.name not in ("__init__.py", "__main__.py")
    }
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, "import circle: " + " → ".join([*path[path.index(node) :], node])
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
