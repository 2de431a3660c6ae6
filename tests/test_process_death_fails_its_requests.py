"""A worker that dies mid-request: its requests end at once with an explicit error (not the idle
timeout), /ready names it, the supervisor restarts it, and new requests succeed again. (A dead
tokenizer worker's prompts are built again instead: test_a_dead_tokenizer_workers_prompts_are_built_again.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.conftest import Server, get_json, wait_ready


@pytest.fixture(scope="module")
def server():
    srv = Server("--tokenizer-workers", "1", env={"VOXPIPE_TEST_PROMPT_DELAY": "slow=6"})
    yield srv
    srv.stop()


def pid_of(server: Server, role: str) -> int:
    _, body = get_json(server.base + "/ready")
    return next(p["pid"] for p in body["processes"] if p["role"] == role)


async def noticed(s: aiohttp.ClientSession, server: Server, role: str, victim: int, within_s: float) -> float:
    """Seconds until /ready shows the dead process: its row not ready, or already a new pid."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        async with s.get(server.base + "/ready") as r:
            rows = [p for p in (await r.json())["processes"] if p["role"] == role]
        if (
            r.status == 503
            and any(p["state"] != "ready" for p in rows)
            or all(p["pid"] != victim for p in rows)
        ):
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    return float("inf")


async def request_while_killing(
    server: Server, role: str, body: dict, after_s: float
) -> tuple[str, float, float]:
    """Send `body`, SIGKILL the `role` process after `after_s`: how the request ended, when, and
    how soon /ready showed it."""
    victim = pid_of(server, role)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(server.base + "/generate", json=body))
        await asyncio.sleep(after_s)
        os.kill(victim, signal.SIGKILL)
        seen = asyncio.create_task(noticed(s, server, role, victim, within_s=3.0))
        try:
            async with await task as r:
                payload = await r.read()
                outcome = f"{r.status} {payload[:200]!r}" if r.status != 200 else "200"
        except aiohttp.ClientPayloadError:
            outcome = "broken stream"
        took = time.monotonic() - t0
        return outcome, took, await seen


@pytest.mark.parametrize(
    ("role", "body"),
    [
        ("gpu_worker", {"text": "A long one.", "max_tokens": 400, "min_tokens": 380, "streaming": False}),
        ("codec_worker", {"text": "A long one.", "max_tokens": 400, "min_tokens": 380}),
    ],
)
def test_a_dead_worker_fails_its_requests_and_comes_back(server, role, body):
    outcome, took, seen_after = asyncio.run(request_while_killing(server, role, body, after_s=0.7))
    assert outcome.startswith("503") or outcome == "broken stream", outcome
    assert took < 10, f"ended after {took:.1f} s: the idle timeout, not the death, ended it"
    # Heartbeats every 0.25 s, stale after 1 s; a fast restart may replace the row first.
    assert seen_after < 1.5, f"/ready showed the dead {role} only after {seen_after:.2f} s"
    wait_ready(server.base, server.proc, timeout=60)  # the supervisor restarted it
    status, payload = asyncio.run(one_request(server))
    assert status == 200, payload[:300]


async def one_request(server: Server) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/generate", json={"text": "Back again.", "max_tokens": 80}) as r:
            return r.status, await r.read()
