"""`voxpipe serve --mps`: the launcher starts a private MPS control daemon, makes the gpu_worker and
codec_worker (and no other process) its clients, and quits it at shutdown; a daemon the user runs
is used and left alone; without the control program `on` fails clearly and `auto` serves without.

The real `nvidia-cuda-mps-control` needs an NVIDIA driver, so on this CPU machine a stand-in on
PATH records what it is asked (`-d`, then `quit` on stdin) and the environment it got."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from common.config import CodecSettings, ServeConfig
from common.launcher import Supervisor
from common.mps import CONTROL, MpsDaemon, mps_for

STAND_IN = f"""#!{sys.executable}
import json, os, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
with open(os.path.join(pipe, "calls.jsonl"), "a") as f:
    stdin = "" if sys.argv[1:] else sys.stdin.read()
    f.write(json.dumps({{"args": sys.argv[1:], "stdin": stdin, "log": os.environ["CUDA_MPS_LOG_DIRECTORY"]}}) + "\\n")
sys.exit(int(os.environ.get("STAND_IN_EXIT", "0")))
"""


@pytest.fixture
def control_on_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / CONTROL
    exe.write_text(STAND_IN)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return exe


def _calls(pipe_dir: str) -> list[dict]:
    with open(os.path.join(pipe_dir, "calls.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_serve_starts_a_private_daemon_for_the_gpu_processes_and_quits_it(control_on_path, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    sup = Supervisor(ServeConfig(mps="on", run_dir=run_dir, codec=CodecSettings(gpu_share=30)))
    assert sup.mps is not None
    sup.mps.start()
    pipe = os.path.join(run_dir, "mps-pipe")
    assert _calls(pipe) == [{"args": ["-d"], "stdin": "", "log": os.path.join(run_dir, "mps-log")}]
    for child in sup.children:
        env = sup.child_env(child)
        if child.role in ("gpu_worker", "codec_worker"):
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe, child.name
        else:
            assert "CUDA_MPS_PIPE_DIRECTORY" not in env, child.name
        # --codec-gpu-share caps the codec's SMs alone
        share = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        assert share == ("30" if child.role == "codec_worker" else None), child.name
    sup.stop()
    assert _calls(pipe)[1:] == [{"args": [], "stdin": "quit\n", "log": os.path.join(run_dir, "mps-log")}]
    sup.stop()  # a second stop does not quit it again
    assert len(_calls(pipe)) == 2


def test_a_users_daemon_is_used_and_left_running(control_on_path, tmp_path, monkeypatch):
    theirs = tmp_path / "their-pipe"
    theirs.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(theirs))
    daemon = mps_for("auto", str(tmp_path))
    assert daemon is not None and daemon.env["CUDA_MPS_PIPE_DIRECTORY"] == str(theirs)
    daemon.start()
    daemon.stop()
    assert not (theirs / "calls.jsonl").exists()  # neither started nor quit


def test_without_the_control_program_on_fails_clearly_and_auto_goes_without(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    assert mps_for("off", str(tmp_path)) is None
    assert mps_for("auto", str(tmp_path)) is None
    with pytest.raises(RuntimeError, match=CONTROL):
        mps_for("on", str(tmp_path)).start()
    with pytest.raises(ValueError, match="--mps"):
        mps_for("always", str(tmp_path))
    # The daemon changes directory: a relative --run-dir still gives it absolute paths.
    rel = MpsDaemon("run", {"PATH": str(tmp_path)})
    assert os.path.isabs(rel.pipe_dir) and os.path.isabs(rel.env["CUDA_MPS_LOG_DIRECTORY"])


def test_a_daemon_that_fails_to_start_stops_the_server_with_its_reason(
    control_on_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("STAND_IN_EXIT", "1")
    daemon = mps_for("on", str(tmp_path))
    with pytest.raises(RuntimeError, match="-d failed"):
        daemon.start()
    assert not daemon.started


def _daemon_only(mode: str, run_dir: str, probe: str) -> Supervisor:
    """A Supervisor whose start() runs the daemon's part only (no processes), with a CUDA probe
    that runs `probe` as Python (the real one needs a GPU)."""
    sup = Supervisor(ServeConfig(mps=mode, run_dir=run_dir))
    sup.children = []
    sup.mps_probe = [sys.executable, "-c", probe]
    return sup


def test_auto_serves_without_mps_when_the_daemon_will_not_start(control_on_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_EXIT", "1")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # start() writes its state file there
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    sup = _daemon_only("auto", run_dir, "pass")
    sup.start()
    assert sup.mps is None
    sup.stop()
    with pytest.raises(RuntimeError, match="-d failed"):
        _daemon_only("on", run_dir, "pass").start()


def test_a_daemon_whose_clients_cannot_run_is_quit(control_on_path, tmp_path, monkeypatch):
    # The daemon starts, but a CUDA client cannot work under it (compute mode, a container...):
    # auto quits it and serves without MPS, on stops with the client's complaint.
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    pipe = os.path.join(run_dir, "mps-pipe")
    sup = _daemon_only("auto", run_dir, "raise SystemExit('all CUDA-capable devices are busy')")
    sup.start()
    assert sup.mps is None
    assert [c["args"] or c["stdin"] for c in _calls(pipe)] == [["-d"], "quit\n"]
    sup.stop()
    with pytest.raises(RuntimeError, match="devices are busy"):
        _daemon_only("on", run_dir, "raise SystemExit('all CUDA-capable devices are busy')").start()
    assert [c["args"] or c["stdin"] for c in _calls(pipe)][2:] == [["-d"], "quit\n"]
    ok = _daemon_only("on", run_dir, "pass")
    ok.start()
    assert ok.mps is not None and ok.mps.started
    ok.stop()
    assert _calls(pipe)[-1]["stdin"] == "quit\n"
