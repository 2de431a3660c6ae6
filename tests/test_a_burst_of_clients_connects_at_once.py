"""A burst of clients connects at once: the gateway listens with a backlog (`--listen-backlog`,
4096) that holds every connection of a burst until its event loop accepts it. With aiohttp's own
128, the kernel drops the SYNs beyond the queue and each of those clients connects only when its
SYN is retried, ~1 s later: a second in the first audio of two thirds of a burst of 384.

The test stops the gateway process (SIGSTOP: nothing is accepted), opens more connections than 128
at once, and counts those whose handshake completed, that is those the kernel queued for it."""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from bench.connect_burst import one_round, summary
from common.config import GatewaySettings
from common.ipc import Addresses
from common.proc import kernel_backlog_cap
from gateway.__main__ import check_backlog
from tests.conftest import ROOT, free_port, get_json, worker_env

CONNECTS = 300  # a burst beyond aiohttp's 128 and within the default 4096


def start_gateway(*args: str, preexec_fn=None) -> tuple[subprocess.Popen, int]:
    """`python -m gateway` alone (no workers: it listens and answers /health) on a free port
    (`preexec_fn`: run in the child before it starts)."""
    port = free_port()
    addrs = Addresses.tcp(ports={f: free_port() for f in Addresses.__struct_fields__})
    env = {**worker_env(), **{f"VOXPIPE_{f.upper()}": getattr(addrs, f) for f in Addresses.__struct_fields__}}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", "orpheus-tiny", "--port", str(port), *args],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=preexec_fn,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"gateway exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
            )
        try:
            if get_json(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError("the gateway did not listen within 60 s")


def stop(proc: subprocess.Popen) -> str:
    """Stop the gateway → what it logged."""
    proc.terminate()
    try:
        return proc.communicate(timeout=15)[1].decode()
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1].decode()


def connect_at_once(port: int, n: int, into: list[socket.socket]) -> None:
    """`n` non-blocking connects to `port` on this host, as fast as they go out, into `into` (the
    caller closes them, also where one fails)."""
    for _ in range(n):
        s = socket.socket()
        into.append(s)
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))


def queued_connections(pid: int, port: int, n: int) -> int:
    """With process `pid` stopped, `n` connections to `port` at once → how many completed their
    handshake (the kernel queued them for the process to accept) within half a second, well before
    a dropped SYN is retried."""
    socks: list[socket.socket] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        connect_at_once(port, n, socks)
        time.sleep(0.5)
        _, writable, _ = select.select([], socks, [], 0)
        return sum(s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0 for s in writable)
    finally:
        os.kill(pid, signal.SIGCONT)
        for s in socks:
            s.close()


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's accept queue as Linux keeps it")
@pytest.mark.parametrize("backlog", [None, 128], ids=["default", "aiohttp's 128"])
def test_the_kernel_queues_a_whole_burst_of_connections_for_the_gateway(backlog: int | None) -> None:
    cap = kernel_backlog_cap()
    if backlog is None and (cap is None or cap < CONNECTS):
        pytest.skip(f"net.core.somaxconn is {cap}: the kernel queues fewer than {CONNECTS} connections")
    proc, port = start_gateway(*(["--listen-backlog", str(backlog)] if backlog else []))
    try:
        queued = queued_connections(proc.pid, port, CONNECTS)
        if backlog is None:
            assert queued == CONNECTS, f"{CONNECTS - queued} of {CONNECTS} connections wait for a SYN retry"
        else:  # Linux queues backlog + 1; the rest wait
            assert queued <= backlog + 1, queued
        # and the gateway serves on once it runs again: every client of a burst gets its answer
        # (`voxpipe bench connect`'s round)
        assert get_json(f"http://127.0.0.1:{port}/health", timeout=5)[0] == 200
        connect, answer = one_round("127.0.0.1", port, CONNECTS)
        figures = summary(connect, answer)
        assert figures["connections"] == CONNECTS and figures["answer_p99_ms"] >= figures["connect_p50_ms"]
    finally:
        stop(proc)


def test_the_backlog_is_a_setting_checked_against_the_kernels_cap(caplog, tmp_path) -> None:
    assert GatewaySettings().listen_backlog == 4096
    with pytest.raises(ValueError, match="--listen-backlog"):
        GatewaySettings(listen_backlog=0).check()
    cap = tmp_path / "somaxconn"
    cap.write_text("1024\n")
    assert kernel_backlog_cap(str(cap)) == 1024
    assert kernel_backlog_cap(str(tmp_path / "absent")) is None
    with caplog.at_level(logging.WARNING, logger="gateway"):
        check_backlog(4096, 4096)
        check_backlog(4096, None)
        assert not caplog.records
        check_backlog(4096, 1024)
    assert "net.core.somaxconn" in caplog.text and "1024" in caplog.text


def test_the_compose_gateway_gets_a_kernel_queue_as_deep_as_its_backlog() -> None:
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        gateway = yaml.safe_load(f)["services"]["gateway"]
    assert int(gateway["sysctls"]["net.core.somaxconn"]) >= GatewaySettings().listen_backlog
