"""A streaming client that stops reading (its buffers fill, each write waits) would hold its stream's
slot at admission for as long as it keeps the connection open. Past `--send-timeout` seconds on one
write the gateway takes it for gone: it drops the connection and the slot serves the next request.

A real gateway over HTTP and ZMQ with one stream at a time (`--max-streams 1`), the test playing the
other processes (`tests.test_gateway.FakeWorkers`): a client asks for speech and never reads while
the codec's audio comes; a second request then gets its turn, where it would otherwise wait out the
queue and get a 503."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from common.config import GatewaySettings
from tests.test_admission_queues_then_refuses_with_retry_after import make_rig  # noqa: F401 (fixture)
from tests.test_gateway import _pcm

SEND_TIMEOUT_S = 0.5
QUEUE_TIMEOUT_S = 20.0


async def test_a_client_that_never_reads_is_dropped_and_the_next_request_is_served(make_rig) -> None:  # noqa: F811
    rig = await make_rig(max_streams=1, queue_timeout=QUEUE_TIMEOUT_S, send_timeout=SEND_TIMEOUT_S)
    body = json.dumps({"text": "A long story, told slowly."}).encode()
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # a few KB in flight, then it waits
    silent.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(silent, ("127.0.0.1", rig.client.port))
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    await loop.sock_sendall(silent, head.encode() + body)
    try:
        req = await rig.workers.next_request()
        for start in range(0, 64 * 24_000, 24_000):  # ~64 s of audio, far past what the buffers hold
            await rig.workers.audio(req.rid, _pcm(24_000, start))
        started = time.monotonic()
        second = rig.post(text="Hello there.")
        nxt = await asyncio.wait_for(rig.workers.next_request(), QUEUE_TIMEOUT_S + 5)
        waited = time.monotonic() - started
        assert nxt.rid != req.rid
        # it got the stream once the silent client's write timed out, not when the queue gave up
        assert waited < QUEUE_TIMEOUT_S / 2, waited
        await rig.finish(nxt.rid)
        resp = await second
        assert resp.status == 200
        # the silent client's connection is gone: what it can still read ends
        while await asyncio.wait_for(loop.sock_recv(silent, 65536), 10):
            pass
    finally:
        silent.close()
    assert await rig.metric('voxpipe_requests_total{endpoint="generate",outcome="cancelled"}') == 1


def test_the_send_timeout_is_a_setting_with_a_default() -> None:
    assert GatewaySettings().send_timeout == 60.0
    with pytest.raises(ValueError, match="--send-timeout"):
        GatewaySettings(send_timeout=0).check()
