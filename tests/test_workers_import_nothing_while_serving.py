"""An import inside a step stalls it for the module's whole load, at the first request that takes
the code path (numpy.ma, which np.quantile pulls in, held one gpu_worker step 50-80 ms at the
first busy second of a load on the H100). `LateImports` (common/late_imports.py) names the
modules loaded since a worker became ready, and the workers log them; the modules that the
serving paths are known to pull in late are imported at startup. Each check runs in a fresh
interpreter: in this one, other tests have imported them already."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from common.late_imports import LateImports, describe

ROOT = Path(__file__).resolve().parents[1]


def fresh(code: str) -> str:
    """`code` run by a new interpreter in the repository root → its stdout's last line."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_late_imports_names_the_modules_loaded_since_and_only_once(tmp_path, monkeypatch):
    (tmp_path / "late_pkg_xyz").mkdir()
    (tmp_path / "late_pkg_xyz" / "__init__.py").write_text("from . import inner\n")
    (tmp_path / "late_pkg_xyz" / "inner.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    late = LateImports()
    assert late.check() == []
    import late_pkg_xyz  # noqa: F401

    names = late.check()
    assert names == ["late_pkg_xyz", "late_pkg_xyz.inner"]
    assert late.check() == []  # said once
    assert describe(names) == "2 modules of late_pkg_xyz: late_pkg_xyz, late_pkg_xyz.inner"
    assert describe([f"p.m{i}" for i in range(15)], most=3) == "15 modules of p: p.m0, p.m1, p.m2 (+12 more)"


def test_the_step_clocks_span_quantile_imports_nothing_once_the_scheduler_is_loaded():
    # The first `rows_time_high` over enough steps calls np.quantile (numpy.ma at its first call).
    line = fresh(
        """
        from gpu_worker.scheduler import pacing
        from common.late_imports import LateImports
        clock = pacing.StepClock(rows_per_second=82.0, max_batch=64)
        for i in range(300):
            clock.record(8, 0.004 + 0.0001 * (i % 7), now=0.01 * i)
        late = LateImports()
        assert clock.rows_time_high(7) > 0
        print(late.check())
        """
    )
    assert line == "[]", f"the first span quantile imported {line}"


def test_a_large_send_without_a_copy_imports_nothing_once_the_channels_are_loaded():
    # pyzmq's zero-copy send of a frame past zmq.COPY_THRESHOLD loads zmq.utils.garbage at its first.
    line = fresh(
        """
        import tempfile, os
        from common.ipc import PullChannel, PushChannel
        from common.late_imports import LateImports
        from common.messages import AudioChunks, AudioChunk
        addr = "ipc://" + os.path.join(tempfile.mkdtemp(), "s")
        pull = PullChannel(addr, AudioChunks, bind=True)
        push = PushChannel(addr)
        late = LateImports()
        push.send(AudioChunks(chunks=[AudioChunk(rid="r", index=0, pcm=bytes(1 << 20))], finished=[]))
        got = pull.recv(timeout_ms=5000)
        assert got is not None and len(got.chunks[0].pcm) == 1 << 20
        print(late.check())
        """
    )
    assert line == "[]", f"the first large send imported {line}"
