"""A result file's commit (bench/provenance.py `commit`): the checkout's HEAD, with "-dirty" where a
tracked file differs from it (edits not committed, or a later tree copied over an older .git, as a
remote GPU machine's copy can be); VOXPIPE_COMMIT, where set, instead."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def measured(root: Path, **env: str) -> str:
    code = "from bench.provenance import commit; print(commit())"
    environ = {k: v for k, v in os.environ.items() if k != "VOXPIPE_COMMIT"} | env
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=environ, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def test_the_commit_is_head_and_dirty_where_tracked_files_differ(tmp_path):
    (tmp_path / "bench").mkdir()
    shutil.copy(REPO / "bench" / "provenance.py", tmp_path / "bench" / "provenance.py")
    (tmp_path / "bench" / "__init__.py").write_text("")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "one")
    git(tmp_path, "tag", "v1")  # a tag does not replace the hash
    head = git(tmp_path, "rev-parse", "--short=7", "HEAD")
    assert measured(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("not part of the tree measured")
    assert measured(tmp_path) == head
    (tmp_path / "bench" / "__init__.py").write_text("# changed\n")
    assert measured(tmp_path) == f"{head}-dirty"
    assert measured(tmp_path, VOXPIPE_COMMIT="abc1234") == "abc1234"
