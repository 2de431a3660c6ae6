"""README.md opens with the install+serve and install+test commands, and CI runs the latter."""

from __future__ import annotations

import os
import re

from tests.conftest import ROOT


def _blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```bash\n(.*?)```", f.read(), flags=re.S)


def test_readme_opens_with_serve_then_test_commands():
    serve, test = (b.strip() for b in _blocks()[:2])
    assert "voxpipe serve --model orpheus-tiny" in serve and "torch==2.13.0" in serve
    assert "pytest" in test and "torch==2.13.0" in test


def test_ci_runs_the_readme_test_command():
    test = _blocks()[1].strip()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert test in ci.splitlines()
