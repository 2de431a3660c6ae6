"""Which commit a result was measured at, for the result files' `commit` field."""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def commit() -> str:
    """The commit measured: VOXPIPE_COMMIT when set (a copy of the tree whose .git is not its own,
    as a remote GPU tool makes), else the HEAD of the checkout this file is in ("" outside one)."""
    if os.environ.get("VOXPIPE_COMMIT"):
        return os.environ["VOXPIPE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5, cwd=ROOT
        )
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
