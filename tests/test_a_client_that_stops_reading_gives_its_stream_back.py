"""A streaming client that stops reading (its buffers fill, each write waits) would hold its stream's
slot at admission for as long as it keeps the connection open. Past `--send-timeout` seconds on one
write the gateway takes it for gone: it drops the connection and the slot serves the next request.

With one stream at a time (`--max-streams 1`), a client sends a long text and never reads; a second
request then gets its audio, where it would otherwise wait out the queue and get a 503."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from common.config import GatewaySettings
from tests.conftest import Server

SEND_TIMEOUT_S = 2.0
QUEUE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def one_stream() -> Server:
    srv = Server(
        "--max-streams", "1", "--queue-timeout", str(QUEUE_TIMEOUT_S), "--send-timeout", str(SEND_TIMEOUT_S)
    )  # fmt: skip
    yield srv
    srv.stop()


def test_a_client_that_never_reads_is_dropped_and_the_next_request_is_served(one_stream: Server) -> None:
    body = json.dumps(
        {"text": "A long story, told slowly. " * 40, "max_tokens": 400, "min_tokens": 390}
    ).encode()
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a few KB in flight, then it waits
    silent.connect(("127.0.0.1", one_stream.port))
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    silent.sendall(head.encode() + body)
    try:
        time.sleep(1.0)  # it holds the one stream now
        started = time.monotonic()
        req = urllib.request.Request(
            f"{one_stream.base}/generate",
            data=json.dumps({"text": "Hello there.", "max_tokens": 40}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=QUEUE_TIMEOUT_S + 30) as r:
            assert r.status == 200 and len(r.read()) > 44
        waited = time.monotonic() - started
        # it waited for the silent client's write to time out, not for the queue to give up
        assert waited < QUEUE_TIMEOUT_S, waited
        # the silent client's connection is gone: what it can still read ends
        silent.settimeout(10)
        while silent.recv(65536):
            pass
    finally:
        silent.close()


def test_the_send_timeout_is_a_setting_with_a_default() -> None:
    assert GatewaySettings().send_timeout == 60.0
    with pytest.raises(ValueError, match="--send-timeout"):
        GatewaySettings(send_timeout=0).check()
