"""What a result file says of how it was made: the commit measured (`commit`) and the command
(`command`)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

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


def command(prog: str, argv: list[str] | None) -> str:
    """The command line of a bench: `prog` (as the user types it) and its arguments, `argv` or
    this process's own when None."""
    return shlex.join([prog, *(sys.argv[1:] if argv is None else argv)])
