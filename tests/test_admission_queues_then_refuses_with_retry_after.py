"""Admission in the gateway: streams up to the gpu_workers' capacity, then a bounded FIFO, then 503
with Retry-After naming the setting to raise. Real gateway over HTTP and ZMQ, the test playing
the other processes (`tests.test_gateway.FakeWorkers`)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.config import GatewaySettings, ServeConfig, TokenizerSettings
from common.ipc import Addresses
from common.messages import FinishReason, ProcState, ProcStatus
from gateway.server import GATEWAY, build_app
from tests.test_gateway import FakeWorkers, _pcm


class Rig:
    def __init__(self, client: TestClient, workers: FakeWorkers) -> None:
        self.client, self.workers = client, workers

    def post(self, path: str = "/generate", **body: Any) -> asyncio.Task:
        body = body or {"text": "hi", "streaming": False}
        return asyncio.create_task(self.client.post(path, json=body))

    async def finish(self, rid: str) -> None:
        await self.workers.audio(rid, _pcm(100), finish=FinishReason.STOP)

    async def metric(self, name: str) -> float:
        text = await (await self.client.get("/metrics")).text()
        line = next(x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])


@pytest.fixture
async def make_rig() -> AsyncIterator[Any]:
    made: list[tuple[TestClient, FakeWorkers, str]] = []

    async def make(**cfg: Any) -> Rig:
        run = tempfile.mkdtemp(prefix="vpadm-")
        addrs = Addresses.local(run)
        workers = FakeWorkers(addrs)
        conf = ServeConfig(
            model="orpheus-tiny",
            tokenizer=TokenizerSettings(workers=1),
            addresses=addrs,
            gateway=GatewaySettings(**cfg),
        )
        client = TestClient(TestServer(build_app(conf)))
        await client.start_server()
        await workers.join_gpu_pool(client.app)
        await workers.announce(client.app, conf.model)
        made.append((client, workers, run))
        return Rig(client, workers)

    yield make
    for client, workers, run in made:
        await client.close()
        workers.close()
        shutil.rmtree(run, ignore_errors=True)


async def test_requests_beyond_streams_and_queue_get_503_with_retry_after(make_rig) -> None:
    rig = await make_rig(max_streams=1, max_queue=1, queue_timeout=30.0)
    first = rig.post()
    req1 = await rig.workers.next_request()  # admitted: it reached the tokenizer pool
    second = rig.post()  # waits in the gateway's queue
    await _until(lambda: rig.metric("voxpipe_admission_queue_length"), 1)
    third = await rig.post("/v1/audio/speech", input="hi", model="orpheus-tiny", response_format="wav")
    assert third.status == 503
    assert int(third.headers["Retry-After"]) >= 1
    err = (await third.json())["error"]
    assert err["type"] == "server_error" and "--max-queue" in err["message"], err
    fourth = await rig.post()
    assert fourth.status == 503 and "--max-queue" in (await fourth.json())["error"]
    assert not second.done()  # still queued, not refused

    await rig.finish(req1.rid)
    assert (await first).status == 200
    req2 = await rig.workers.next_request()  # the queued one goes next, once a stream is free
    await rig.finish(req2.rid)
    assert (await second).status == 200
    assert await rig.metric('voxpipe_requests_total{endpoint="generate",outcome="rejected"}') == 1
    assert await rig.metric('voxpipe_requests_total{endpoint="speech",outcome="rejected"}') == 1
    assert await rig.metric('voxpipe_rejected_requests_total{reason="queue_full"}') == 2
    assert await rig.metric("voxpipe_admitted_streams") == 0


async def test_a_queued_request_past_queue_timeout_gets_503_naming_the_setting(make_rig) -> None:
    rig = await make_rig(max_streams=1, max_queue=4, queue_timeout=0.3)
    first = rig.post()
    req = await rig.workers.next_request()
    late = await rig.post()
    assert late.status == 503 and "Retry-After" in late.headers
    assert "--queue-timeout" in (await late.json())["error"]
    await rig.finish(req.rid)
    assert (await first).status == 200
    assert await rig.metric('voxpipe_rejected_requests_total{reason="queue_timeout"}') == 1


async def test_capacity_comes_from_the_gpu_workers_heartbeat(make_rig) -> None:
    rig = await make_rig(max_queue=0)
    gateway = rig.client.app[GATEWAY]
    assert gateway.admission.limit() is None  # nobody reported: the credit flow alone holds prompts
    status = ProcStatus(name="gpu_worker", role="gpu_worker", pid=1, state=ProcState.READY, time=time.time())
    status.capacity = 4  # max batch size, until the engine measures
    await rig.workers.send(status)
    await _until(lambda: _async(gateway.admission.limit()), 4)
    status.metrics = {"stream_capacity": 2.7}  # measured: 2 streams keep real time
    await rig.workers.send(status)
    await _until(lambda: _async(gateway.admission.limit()), 2)
    assert await rig.metric("voxpipe_stream_limit") == 2
    tasks = [rig.post(), rig.post()]
    reqs = [await rig.workers.next_request() for _ in tasks]
    refused = await rig.post()  # --max-queue 0: no waiting at all
    assert refused.status == 503
    for req in reqs:
        await rig.finish(req.rid)
    assert [(await t).status for t in tasks] == [200, 200]


async def _async(value: Any) -> Any:
    return value


async def _until(read: Any, want: float, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := await read()) != want:
        assert time.monotonic() < deadline, f"got {got}, want {want}"
        await asyncio.sleep(0.02)
