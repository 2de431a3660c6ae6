"""The gateway may hold a connection for every request in its queue (`--max-queue`, 1024) and every
stream at once, a file descriptor each. A host's default soft limit on open files is often 1024
(or less in a container): past it the gateway cannot accept, and clients are cut off unanswered.
So the gateway raises its own soft limit to its hard limit (at most 65536) at start, and warns
where the hard limit is below what it may hold.

The test starts a gateway under a soft limit of 256 (hard 4096) and holds 300 connections open at
once, each with an answered request."""

from __future__ import annotations

import logging
import resource
import selectors
import socket
import time

import pytest

from common.config import GatewaySettings, ServeConfig
from common.proc import raise_open_files
from gateway.__main__ import OPEN_FILES, check_open_files, files_needed
from tests.test_a_burst_of_clients_connects_at_once import connect_at_once, start_gateway, stop

HELD = 300  # connections held at once, beyond the soft limit the gateway starts with


def low_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))


def held_answers(port: int, n: int, timeout_s: float = 10.0) -> dict[bytes, int]:
    """`n` connections at once, each asking for /health and kept open → how many got each kind of
    answer (its first 12 bytes; b"" where the connection closed unanswered)."""
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    asked, kinds = set(), {}
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # keep-alive: the connection stays
    try:
        connect_at_once(port, n, socks)
        for s in socks:
            sel.register(s, selectors.EVENT_WRITE)
        deadline = time.monotonic() + timeout_s
        while sum(kinds.values()) < n and time.monotonic() < deadline:
            for ready, _ in sel.select(0.1):
                s = ready.fileobj
                if s not in asked:
                    asked.add(s)
                    s.sendall(request)
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                try:
                    data = s.recv(65536)
                except ConnectionResetError:
                    data = b""
                kinds[data[:12]] = kinds.get(data[:12], 0) + 1
                sel.unregister(s)
        return kinds
    finally:
        sel.close()
        for s in socks:
            s.close()


def test_a_gateway_started_under_a_low_soft_limit_holds_every_connection() -> None:
    proc, port = start_gateway(preexec_fn=low_limit)
    try:
        limits = open(f"/proc/{proc.pid}/limits").read()
        files = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        assert files.split()[3:5] == ["4096", "4096"], files  # raised to the hard limit
        assert held_answers(port, HELD) == {b"HTTP/1.1 200": HELD}
    finally:
        log = stop(proc)
    assert "may open only" not in log  # 4096 covers the default queue and streams


def test_the_limit_is_raised_within_the_hard_limit_and_short_of_it_the_gateway_warns(caplog) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert raise_open_files(16) == (
        -1 if soft == resource.RLIM_INFINITY else soft,
        -1 if hard == resource.RLIM_INFINITY else hard,
    ), "never lowered"
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
    cfg = ServeConfig(model="orpheus-tiny")
    assert files_needed(cfg) == GatewaySettings().max_queue + 512 + 256 < OPEN_FILES
    small = ServeConfig(model="orpheus-tiny", gateway=GatewaySettings(max_queue=10, max_streams=20))
    assert files_needed(small) == 10 + 20 + 256
    with caplog.at_level(logging.WARNING, logger="gateway"):
        check_open_files(2000, 4096)
        check_open_files(2000, -1)
        assert not caplog.records
        check_open_files(2000, 1024)
    assert "--max-queue" in caplog.text and "1024" in caplog.text


@pytest.fixture(autouse=True)
def _restore_limit():
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, before)
