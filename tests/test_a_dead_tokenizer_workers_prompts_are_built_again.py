"""Building a prompt is idempotent: a tokenizer worker that dies while it builds one costs no
request. The gateway hands the request to another worker (or the restarted one), ahead of new
requests; a second answer for it (the dead worker's, already on its way) is dropped; and after
`PROMPT_TRIES` workers died on it, the request fails with an explicit 503."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from common.messages import GenerateRequest, ProcState, ProcStatus, Prompt
from common.pool import AsyncWorkChannel
from gateway.pipeline import PROMPT_TRIES
from gateway.server import GATEWAY
from tests.conftest import Server, get_json
from tests.test_gateway import Rig, make_addrs, start_rig  # noqa: F401 (the fixtures)


async def status(rig: Rig, name: str, pid: int, state: ProcState) -> None:
    await rig.workers.send(ProcStatus(name=name, role="tokenizer_worker", pid=pid, state=state))


async def test_a_prompt_is_built_again_up_to_its_tries_then_fails(start_rig) -> None:  # noqa: F811
    rig = await start_rig(tokenizer=False)
    gw = rig.client.app[GATEWAY]
    name = "tokenizer_worker.7"
    worker = AsyncWorkChannel[GenerateRequest](rig.cfg.addresses.requests, GenerateRequest, name=name)
    try:
        await status(rig, name, 1, ProcState.READY)
        post = rig.post(json={"text": "Hello there.", "streaming": False})
        got = [await asyncio.wait_for(worker.recv(), 5)]
        for pid in range(1, PROMPT_TRIES + 1):  # each instance dies with the request in hand
            await status(rig, name, pid, ProcState.FAILED)
            if pid < PROMPT_TRIES:
                got.append(await asyncio.wait_for(worker.recv(), 5))
                await status(rig, name, pid + 1, ProcState.READY)  # the restarted one
        resp = await asyncio.wait_for(post, 5)
        assert resp.status == 503 and "stopped while handling" in (await resp.json())["error"]
        assert [r.rid for r in got] == [got[0].rid] * PROMPT_TRIES
        assert [r.urgent for r in got] == [False] + [True] * (PROMPT_TRIES - 1), "rebuilds go first"
        assert not gw._building, "nothing of the request stays behind"
    finally:
        worker.close()


async def test_only_the_first_prompt_for_a_request_reaches_a_gpu_worker(start_rig) -> None:  # noqa: F811
    rig = await start_rig(tokenizer=False)
    name = "tokenizer_worker.3"
    worker = AsyncWorkChannel[GenerateRequest](rig.cfg.addresses.requests, GenerateRequest, name=name)
    try:
        await status(rig, name, 10, ProcState.READY)
        post = rig.post(json={"text": "Hello there.", "streaming": False})
        req = await asyncio.wait_for(worker.recv(), 5)
        await status(rig, name, 10, ProcState.FAILED)
        again = await asyncio.wait_for(worker.recv(), 5)
        assert again.rid == req.rid
        n_codebooks = rig.client.app[GATEWAY].spec.n_codebooks
        prompt = Prompt(req.rid, bytes(4 * n_codebooks), 1, req.sampling, req.arrival)
        await rig.workers.send(prompt)  # the dead worker's, on its way before it died
        await rig.workers.send(prompt)  # the rebuilt one
        first = await rig.workers.next_gpu_msg()
        assert isinstance(first, Prompt) and first.rid == req.rid
        with pytest.raises(asyncio.TimeoutError):
            await rig.workers.next_gpu_msg(timeout=0.5)
        post.cancel()
    finally:
        worker.close()


# -- a real tokenizer worker, killed -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = Server("--tokenizer-workers", "1", env={"VOXPIPE_TEST_PROMPT_DELAY": "slow=2"})
    yield srv
    srv.stop()


async def post(s: aiohttp.ClientSession, base: str, text: str) -> tuple[int, float]:
    t0 = time.monotonic()
    body = {"text": text, "max_tokens": 80, "streaming": False}
    async with s.post(base + "/generate", json=body) as r:
        await r.read()
        return r.status, time.monotonic() - t0


def test_requests_at_a_killed_tokenizer_worker_are_served_by_its_successor(server):
    _, ready = get_json(server.base + "/ready")
    victim = next(p["pid"] for p in ready["processes"] if p["role"] == "tokenizer_worker")

    async def run() -> tuple[list[tuple[int, float]], float]:
        async with aiohttp.ClientSession() as s:
            building = asyncio.create_task(post(s, server.base, "slow prompt, killed while built"))
            await asyncio.sleep(0.7)
            os.kill(victim, signal.SIGKILL)
            t_kill = time.monotonic()
            after = asyncio.create_task(post(s, server.base, "Sent right after the kill."))
            results = await asyncio.gather(building, after)
            return list(results), time.monotonic() - t_kill

    results, took = asyncio.run(run())
    assert [code for code, _ in results] == [200, 200], results
    # The restarted worker builds both: the time a worker takes to start is the wait.
    print(f"both served {took:.1f} s after the kill")
