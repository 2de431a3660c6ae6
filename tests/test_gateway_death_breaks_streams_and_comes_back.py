"""The gateway killed mid-stream: its streaming client's connection ends (it is not left open),
the supervisor starts a new gateway on the same port and sockets, the workers find it again, and a
new request then succeeds."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp

from tests.conftest import Server, get_json, wait_ready


async def stream_then_kill(server: Server, victim: int) -> tuple[str, int, float]:
    """Start a long streaming request, kill the gateway once audio flows: how the stream ended,
    the bytes it got, and how long after the kill."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        body = {"text": "A long one.", "max_tokens": 400, "min_tokens": 380}
        async with s.post(server.base + "/generate", json=body) as r:
            assert r.status == 200
            got = len(await r.content.readexactly(44 + 4096))  # header and the first audio
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            try:
                while chunk := await r.content.read(65536):
                    got += len(chunk)
                outcome = "clean end"  # a truncated file that looks complete: what must not happen
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
                outcome = "broken stream"
            return outcome, got, time.monotonic() - killed


def test_a_killed_gateway_breaks_its_streams_is_restarted_and_serves_again() -> None:
    server = Server("--tokenizer-workers", "1")
    try:
        _, ready = get_json(server.base + "/ready")
        pids = {p["role"]: p["pid"] for p in ready["processes"]}
        outcome, got, after = asyncio.run(stream_then_kill(server, pids["gateway"]))
        assert outcome == "broken stream", f"{outcome} after {got} bytes"
        assert after < 5, f"the stream stayed open {after:.1f} s after the gateway died"
        ready = wait_ready(server.base, server.proc, timeout=60)
        new = {p["role"]: p["pid"] for p in ready["processes"]}
        assert new["gateway"] != pids["gateway"], "the supervisor restarted the gateway"
        assert {r: new[r] for r in new if r != "gateway"} == {r: pids[r] for r in pids if r != "gateway"}
        status, audio = asyncio.run(one_request(server))
        assert status == 200 and audio[:4] == b"RIFF" and len(audio) > 44, audio[:300]
    finally:
        server.stop()


async def one_request(server: Server) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        body = {"text": "Back again.", "max_tokens": 80, "streaming": False}
        async with s.post(server.base + "/generate", json=body) as r:
            return r.status, await r.read()
