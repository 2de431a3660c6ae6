"""What a result file says of how it was made: the commit measured (`commit`), the command
(`command`) and the settings the served model chooses for itself (`model_settings`)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def commit() -> str:
    """The commit measured: VOXPIPE_COMMIT when set (a copy of the tree whose .git is not its own,
    as a remote GPU tool makes), else the HEAD of the checkout this file is in, "-dirty" after it
    where tracked files differ from it (edits not committed, or a copy of a later tree over a .git
    left behind) ("" outside a checkout)."""
    if os.environ.get("VOXPIPE_COMMIT"):
        return os.environ["VOXPIPE_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            capture_output=True, text=True, timeout=5, cwd=ROOT,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def model_settings(model: str, serve_args: list[str]) -> dict:
    """The settings `model`'s spec chooses for itself (`common.options.model_defaults`) that
    `serve_args` does not name: with the serve arguments, what the server ran."""
    from common.options import model_defaults

    named = {a.split("=", 1)[0] for a in serve_args if a.startswith("--")}
    return {
        k: v
        for k, v in model_defaults(model).items()
        if not {"--" + k.replace("_", "-"), "--no-" + k.replace("_", "-")} & named
    }


def command(prog: str, argv: list[str] | None) -> str:
    """The command line of a bench: `prog` (as the user types it) and its arguments, `argv` or
    this process's own when None."""
    return shlex.join([prog, *(sys.argv[1:] if argv is None else argv)])
