"""The tokenizer pool over real sockets: real `python -m tokenizer_worker` processes, the gateway's
real `AsyncDispatchChannel`, and the test in the place of the gateway inbox (it collects the built
Prompts and reads ProcStatus). Workers join and leave while requests flow; no
request is lost or built twice, and a slow prompt holds up nobody else.

The workers share one module (starting one costs seconds of imports); each test makes sure the
pool it needs is there. A slow prompt is a text starting with "slow" (VOXPIPE_TEST_PROMPT_DELAY).
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from common.ipc import Addresses, AsyncPullChannel
from common.messages import GatewayInMsg, GenerateRequest, ProcState, ProcStatus, Prompt, SamplingParams
from common.pool import AsyncDispatchChannel
from gateway.pipeline import TOKENIZER_RUN
from tests.conftest import ROOT, worker_env

SLOW_S = 1.5


class PoolRig:
    """An event loop in a thread owns the sockets; tests call it synchronously."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="vppool-")
        self.addrs = Addresses.local(self.dir)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.workers: dict[str, subprocess.Popen] = {}
        self.ready: set[str] = set()
        self.arrivals: list[tuple[str, float]] = []  # (rid, monotonic time) of each Prompt
        self._tasks: set[Any] = set()
        self._call(self._open())

    def _call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self) -> None:
        self.dispatch: AsyncDispatchChannel[GenerateRequest] = AsyncDispatchChannel(
            self.addrs.requests, burst=TOKENIZER_RUN
        )  # as the gateway's
        self.gw_in: AsyncPullChannel[GatewayInMsg] = AsyncPullChannel(self.addrs.gateway_in, GatewayInMsg)
        self._keep(self._collect())

    async def _shut(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.dispatch.close()
        self.gw_in.close()

    def _keep(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _collect(self) -> None:
        while True:
            msg = await self.gw_in.recv()
            if isinstance(msg, Prompt):
                self.arrivals.append((msg.rid, time.monotonic()))
            elif isinstance(msg, ProcStatus):
                (self.ready.add if msg.state == ProcState.READY else self.ready.discard)(msg.name)

    def start_worker(self, name: str) -> subprocess.Popen:
        a = self.addrs
        argv = [sys.executable, "-m", "tokenizer_worker", "--model", "orpheus-tiny", "--name", name]
        argv += ["--requests", a.requests, "--gateway-in", a.gateway_in]
        env = {**worker_env(), "VOXPIPE_TEST_PROMPT_DELAY": f"slow={SLOW_S}"}
        self.workers[name] = subprocess.Popen(argv, env=env, cwd=ROOT)
        return self.workers[name]

    def wait_ready(self, *names: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not set(names) <= self.ready:
            assert time.monotonic() < deadline, f"not ready: {set(names) - self.ready}"
            for name in names:
                assert self.workers[name].poll() is None, f"{name} exited"
            time.sleep(0.05)

    def only(self, name: str) -> None:
        """`name` the pool's one worker: the others leave (SIGTERM) first."""
        for other, proc in self.workers.items():
            if other != name and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(10) == 0
                self.ready.discard(other)
        self.ensure(name)
        deadline = time.monotonic() + 10
        while set(self.dispatch.workers.values()) != {name}:  # the dispatcher saw them leave
            assert time.monotonic() < deadline, self.dispatch.workers
            time.sleep(0.02)

    def ensure(self, *names: str) -> None:
        for name in names:
            if name not in self.workers or self.workers[name].poll() is not None:
                self.ready.discard(name)
                self.start_worker(name)
        self.wait_ready(*names)

    def submit(self, *texts: str) -> list[str]:
        """Send requests in this order (each waits in the dispatcher until a worker is free)."""
        rids = [f"r{len(self.arrivals)}-{time.monotonic_ns()}-{i}" for i in range(len(texts))]

        def go() -> None:
            for rid, text in zip(rids, texts, strict=True):
                self._keep(self.dispatch.send(GenerateRequest(rid, text, SamplingParams(max_tokens=300))))

        self.loop.call_soon_threadsafe(go)
        return rids

    def wait_prompts(self, rids: list[str], timeout: float = 30) -> dict[str, float]:
        """rid → arrival time, once every rid has arrived; fails on a duplicate."""
        deadline = time.monotonic() + timeout
        want = set(rids)
        while True:
            got = collections.Counter(r for r, _ in self.arrivals if r in want)
            assert all(n == 1 for n in got.values()), f"built twice: {[r for r, n in got.items() if n > 1]}"
            if len(got) == len(want):
                return {r: t for r, t in self.arrivals if r in want}
            assert time.monotonic() < deadline, f"lost: {sorted(want - set(got))}"
            time.sleep(0.02)

    def close(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
        self._call(self._shut())  # the loop's tasks end before it stops, none left pending
        self.loop.call_soon_threadsafe(self.loop.stop)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolRig]:
    rig = PoolRig()
    rig.start_worker("tok.a")
    try:
        yield rig
    finally:
        rig.close()


def test_a_worker_started_later_joins_and_takes_work(pool):
    pool.ensure("tok.a")
    pool.wait_prompts(pool.submit(*(f"before {i}" for i in range(5))))
    pool.ensure("tok.b")  # joins while the pool is serving
    before = pool.dispatch.dispatched["tok.b"]
    pool.wait_prompts(pool.submit(*(f"after {i}" for i in range(30))))
    assert pool.dispatch.dispatched["tok.b"] > before, pool.dispatch.dispatched


def test_a_slow_prompt_does_not_hold_up_the_others(pool):
    pool.ensure("tok.a", "tok.b")
    slow = pool.submit("slow prompt")
    time.sleep(0.1)  # the slow one is taken first
    t0 = time.monotonic()
    fast = pool.wait_prompts(pool.submit(*(f"fast {i}" for i in range(10))), timeout=SLOW_S * 4)
    done = pool.wait_prompts(slow)
    assert max(fast.values()) < done[slow[0]], "every fast prompt overtook the slow one"
    assert max(fast.values()) - t0 < SLOW_S, "the fast prompts did not wait for the slow one"


def test_a_worker_stopped_with_sigterm_finishes_its_work_and_none_is_lost(pool):
    pool.ensure("tok.a", "tok.b")
    b = pool.workers["tok.b"]
    before = collections.Counter(pool.dispatch.dispatched)
    rids = pool.submit("slow one", "slow two", *(f"queued {i}" for i in range(20)))
    time.sleep(0.3)  # each worker is inside a slow prompt, the rest wait in the dispatcher
    b.send_signal(signal.SIGTERM)
    pool.wait_prompts(rids, timeout=SLOW_S * 6)
    assert b.wait(10) == 0, "a stopped worker exits cleanly"
    took = collections.Counter(pool.dispatch.dispatched) - before
    assert took["tok.b"] >= 1 and took["tok.a"] + took["tok.b"] == len(rids), took
    # Still serving without it.
    pool.wait_prompts(pool.submit("after the stop"))


def test_requests_waiting_for_a_busy_worker_go_to_it_in_runs_in_order(pool):
    pool.only("tok.a")
    slow = pool.submit("slow first")
    time.sleep(0.3)  # the worker is inside the slow prompt; the next ones wait in the dispatcher
    runs_before = pool.dispatch.runs
    rids = pool.submit(*(f"waiting {i}" for i in range(5 * TOKENIZER_RUN)))
    got = pool.wait_prompts(rids, timeout=SLOW_S * 4)
    pool.wait_prompts(slow)
    assert sorted(got, key=got.get) == rids, "one worker builds its runs in the order they came"
    # handed in runs of TOKENIZER_RUN (the last ones perhaps shorter), not one at a time
    assert pool.dispatch.runs - runs_before >= 4, pool.dispatch.runs - runs_before
    # and a lone request afterwards goes alone: the worker is free, nothing waits
    before = pool.dispatch.runs
    pool.wait_prompts(pool.submit("alone"))
    assert pool.dispatch.runs == before
