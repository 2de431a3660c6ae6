"""The logs of a deployment read as one: every process writes the same timestamp format, a
process's state is named once ("loading orpheus LM", not "loading loading …"), the launcher's own
/ready polls stay out of the INFO log, and a gateway whose port is taken says so in one line (after
nothing claimed it listened) and exits 2."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.launcher import _state_text
from gateway.__main__ import LAUNCHER_AGENT, AccessLog
from tests.conftest import ROOT, free_port, worker_env

LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} [\w.]+\[\d+\] [A-Z]+ [\w.]+: ")  # common.proc.setup_logging


def test_a_state_is_named_once() -> None:
    assert (
        _state_text({"state": "loading", "detail": "loading orpheus LM on cpu"})
        == "loading orpheus LM on cpu"
    )
    assert _state_text({"state": "ready", "detail": ""}) == "ready"
    assert _state_text({"state": "failed", "detail": "cannot load"}) == "failed cannot load"


async def test_the_launchers_ready_polls_are_logged_at_debug_only(caplog) -> None:
    async def ready(_request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app = web.Application()
    app.router.add_get("/ready", ready)
    server = TestServer(app)
    await server.start_server(access_log_class=AccessLog)  # as gateway.__main__ runs the app
    async with TestClient(server) as client:
        with caplog.at_level(logging.INFO, logger="aiohttp.access"):
            await client.get("/ready", headers={"User-Agent": LAUNCHER_AGENT})
            assert not [r for r in caplog.records if r.name == "aiohttp.access"]
            await client.get("/ready", headers={"User-Agent": "a client"})
            assert [r.levelno for r in caplog.records if r.name == "aiohttp.access"] == [logging.INFO]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="aiohttp.access"):
            await client.get("/ready", headers={"User-Agent": LAUNCHER_AGENT})
        assert [r.getMessage() for r in caplog.records] == ["GET /ready 200 (voxpipe serve)"]


def test_a_gateway_on_a_taken_port_says_so_in_the_common_format_and_exits_2(tmp_path) -> None:
    port = free_port()
    run = f"ipc://{tmp_path}"
    argv = [sys.executable, "-m", "gateway", "--port", str(port), "--requests", f"{run}/req",
            "--gateway-in", f"{run}/in", "--gpu-in", f"{run}/gpu"]  # fmt: skip
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        done = subprocess.run(argv, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert all(LINE.match(line) for line in lines), lines
    assert "listening on" not in done.stderr and "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in lines[-1]
