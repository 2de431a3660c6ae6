"""What a restart cannot mend stops `voxpipe serve` at once with one clear line and exit status 2:
a port in use (the server already there keeps its state file), weights the hub cannot give, a CUDA
device this torch cannot use. A process killed from outside while starting is started again. Also the command line's own manners: `--version` (and the license
it ships under), and a serve flag error printed with serve's usage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import tomllib

from common import __version__
from common.cli import main
from common.config import ServeConfig
from common.proc import refusal
from tests.conftest import ROOT, free_port, get_json, worker_env

SERVE = [sys.executable, "-m", "common.cli", "serve", "--model", "orpheus-tiny"]


def _serve(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SERVE, *args], env={**worker_env(), **(env or {})}, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_a_port_in_use_fails_at_once_and_leaves_the_other_servers_state_alone(tmp_path) -> None:
    port = free_port()
    state_dir = tmp_path / "voxpipe"
    state_dir.mkdir()
    state = state_dir / f"{port}.json"
    state.write_text(json.dumps({"pid": os.getpid(), "port": port, "url": "the running one"}))
    with socket.socket() as other:  # the running server's listening socket
        other.bind(("127.0.0.1", port))
        other.listen()
        done = _serve("--port", str(port), env={"XDG_RUNTIME_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "choose another --port" in done.stderr
    assert "started gateway" not in done.stderr and "Traceback" not in done.stderr  # nothing started
    assert json.loads(state.read_text())["url"] == "the running one"


def test_weights_the_hub_cannot_give_are_one_line_naming_what_to_do() -> None:
    from huggingface_hub.errors import LocalEntryNotFoundError

    cfg = ServeConfig(model="orpheus")
    try:
        try:
            raise LocalEntryNotFoundError("cannot find the requested files in the local cache")
        except LocalEntryNotFoundError as e:
            raise OSError("SNAC.from_pretrained failed") from e
    except OSError as wrapped:
        why = refusal(wrapped, cfg)
    assert why.startswith("cannot load the weights of orpheus (LocalEntryNotFoundError")
    assert "--load-format dummy" in why and "\n" not in why
    hub = ConnectionError("the Hugging Face hub is unreachable, and tokenizer.json of x is not cached")
    assert refusal(hub, cfg).startswith("cannot load the weights")
    assert refusal(ValueError("a bug"), cfg) == "" and refusal(ConnectionError("zmq"), cfg) == ""


def test_cuda_asked_of_a_cpu_torch_is_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    try:
        torch.zeros(1, device="cuda")
    except Exception as e:  # AssertionError (CPU build) or RuntimeError (no driver)
        why = refusal(e, ServeConfig(device="cuda"))
    assert why.startswith("--device cuda / --codec-device auto asks for CUDA, but ")
    assert why.endswith("install a CUDA build of torch, or use --device cpu")


def test_serve_with_cuda_on_a_cpu_host_exits_2_with_one_line_per_process() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    done = _serve("--port", str(free_port()), "--device", "cuda")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "cannot start: --device cuda" in done.stderr and "Traceback" not in done.stderr
    assert "restarting" not in done.stderr


def test_version_and_a_serve_flag_error_print_what_they_concern(capsys) -> None:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["version"] == __version__ and project["license"] == {"text": "Apache-2.0"}
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License\n                           Version 2.0" in f.read(200)
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"voxpipe {__version__}"
    with pytest.raises(SystemExit) as done:
        main(["serve", "--gpu-workers", "0"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith("usage: voxpipe serve ") and "--gpu-workers" in err


def test_serve_of_a_model_without_its_weights_exits_2_with_one_line_per_process(tmp_path) -> None:
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}  # an empty cache and no hub
    done = subprocess.run(
        [sys.executable, "-m", "common.cli", "serve", "--model", "orpheus", "--port", str(free_port())],
        env={**worker_env(), **env}, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    refusals = [line for line in done.stderr.splitlines() if "cannot start: cannot load the weights" in line]
    assert refusals and all(line.count("cannot load") == 1 for line in refusals)
    assert "Traceback" not in done.stderr and "restarting" not in done.stderr


def test_a_process_killed_while_starting_is_started_again() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*SERVE, "--port", str(port)], env=worker_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        killed, deadline = None, time.monotonic() + 60
        while killed is None and time.monotonic() < deadline:  # the codec_worker, as soon as it reports
            try:
                _, ready = get_json(f"http://127.0.0.1:{port}/ready", timeout=1)
            except OSError:
                ready = {}
            if ready.get("ready"):
                pytest.skip("every process was ready before one could be killed")
            codec = [p for p in ready.get("processes", []) if p["name"] == "codec_worker" and p.get("pid")]
            if codec:
                killed = codec[0]["pid"]
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        assert killed is not None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if get_json(f"http://127.0.0.1:{port}/ready", timeout=1)[1].get("ready"):
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, "serve gave up instead of starting the killed process again"
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=30)[1]
    assert "codec_worker was killed (signal 9) while starting; restarting it" in err
