"""A worker that stalls is slow, not dead: the codec_worker stopped (SIGSTOP) for 2.5 s, what heavy
CPU load or a long garbage collection looks like from outside, sends no heartbeat and /ready calls
it unresponsive, but every stream in flight ends complete, with the audio it has when nothing stalls.
A stalled worker that is then killed fails its requests at once, with an explicit error."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from common.messages import ProcState, ProcStatus
from gateway.procs import ProcessTable
from tests.conftest import Server, get_json, wait_ready

# min_tokens = max_tokens: every run of a body has one length, whatever the batches sampled
BODIES = [{"text": f"Stream number {i}.", "seed": i, "max_tokens": 400, "min_tokens": 400} for i in range(3)]


@pytest.fixture(scope="module")
def server():
    srv = Server("--tokenizer-workers", "1", "--first-chunk", "fastest")
    yield srv
    srv.stop()


def pid_of(server: Server, role: str) -> int:
    _, body = get_json(server.base + "/ready")
    return next(p["pid"] for p in body["processes"] if p["role"] == role)


async def stream(s: aiohttp.ClientSession, base: str, body: dict) -> tuple[str, int]:
    """(how it ended, audio bytes received)."""
    got = 0
    try:
        async with s.post(base + "/generate", json=body) as r:
            if r.status != 200:
                return f"{r.status} {(await r.read())[:200]!r}", got
            async for chunk in r.content.iter_any():
                got += len(chunk)
    except aiohttp.ClientPayloadError:
        return "broken stream", got
    return "200", got


async def streams_while(server: Server, act, after_s: float) -> tuple[list[tuple[str, int]], float, set[str]]:
    """Run BODIES at once, `act(victim pid)` after `after_s`: their outcomes, the seconds they
    took, and the codec_worker's states /ready showed meanwhile."""
    victim = pid_of(server, "codec_worker")
    states: set[str] = set()
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, server.base, b)) for b in BODIES]
        if act is not None:
            await asyncio.sleep(after_s)
            watch = asyncio.create_task(act(victim, s, states))
        outcomes = await asyncio.gather(*tasks)
        if act is not None:
            await watch
    return list(outcomes), time.monotonic() - t0, states


async def codec_state(s: aiohttp.ClientSession, server: Server) -> str:
    async with s.get(server.base + "/ready") as r:
        return next(p["state"] for p in (await r.json())["processes"] if p["role"] == "codec_worker")


def test_a_stalled_codec_worker_finishes_every_stream(server):
    reference, _, _ = asyncio.run(streams_while(server, None, 0))
    assert all(o == "200" and n > 0 for o, n in reference), reference

    async def stall(victim: int, s: aiohttp.ClientSession, states: set[str]) -> None:
        os.kill(victim, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.5:
                states.add(await codec_state(s, server))
                await asyncio.sleep(0.1)
        finally:
            os.kill(victim, signal.SIGCONT)

    outcomes, took, states = asyncio.run(streams_while(server, stall, after_s=0.8))
    assert "unresponsive" in states, f"/ready never showed the stall: {states}"
    assert outcomes == reference, f"with a 2.5 s stall {outcomes}, without {reference}"
    assert pid_of(server, "codec_worker") is not None


def test_a_stalled_worker_that_is_killed_fails_its_requests_at_once(server):
    wait_ready(server.base, server.proc, timeout=60)
    ended: dict[str, float] = {}

    async def stall_then_kill(victim: int, s: aiohttp.ClientSession, states: set[str]) -> None:
        os.kill(victim, signal.SIGSTOP)
        await asyncio.sleep(1.5)  # unresponsive by now, and none of its requests failed
        states.add(await codec_state(s, server))
        os.kill(victim, signal.SIGKILL)
        ended["kill"] = time.monotonic()

    outcomes, _, states = asyncio.run(streams_while(server, stall_then_kill, after_s=0.8))
    took = time.monotonic() - ended["kill"]
    assert states == {"unresponsive"}, states
    assert all(o.startswith("503") or o == "broken stream" for o, _ in outcomes), outcomes
    assert took < 3, f"the requests ended {took:.1f} s after the kill: the death went unnoticed"
    wait_ready(server.base, server.proc, timeout=60)  # the supervisor restarted it


def test_a_process_elsewhere_is_dead_only_after_the_heartbeat_timeout_or_a_restart() -> None:
    """Where the gateway cannot see the pid (another host or container), silence is death only after
    `heartbeat_timeout_s`; a restarted container's process, whose pid is often its predecessor's,
    is told apart by its PID namespace and ends the old one's requests at once."""
    table = ProcessTable(tokenizer_workers=1, stale_after_s=0.05, heartbeat_timeout_s=0.3)
    table.update(ProcStatus("gpu_worker", "gpu_worker", 7, ProcState.READY, host="boot:1"))
    time.sleep(0.1)
    assert table.newly_dead() == [] and table.report()[1][1]["state"] == "unresponsive"
    time.sleep(0.25)
    assert table.newly_dead() == ["gpu_worker"]
    table.update(ProcStatus("gpu_worker", "gpu_worker", 7, ProcState.READY, host="boot:1"))
    assert table.newly_dead() == []
    assert table.update(ProcStatus("gpu_worker", "gpu_worker", 7, ProcState.READY, host="boot:2"))
