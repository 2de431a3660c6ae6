"""`GET /metrics`: Prometheus text from the gateway's own measurements and the workers' heartbeats,
over real HTTP and ZMQ with the test playing the workers."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from common.messages import FinishReason, ProcState, ProcStatus
from tests.test_gateway import Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

GPU_METRICS = {
    "kv_pages_used": 12.0,
    "kv_pages_total": 416.0,
    "decode_batch_size": 3.0,
    "queue_depth": 2.0,
    "active_streams": 3.0,
    "generated_tokens_total": 1234.0,
    "steps_total": 567.0,
}


async def scrape(rig: Rig) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}."""
    resp = await rig.client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(await resp.text()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _pcm(n: int) -> bytes:
    return np.zeros(n, dtype="<i2").tobytes()


async def test_metrics_count_requests_by_outcome_and_time_the_audio(rig: Rig) -> None:
    before = await scrape(rig)

    def count(after: dict, endpoint: str, outcome: str) -> float:
        key = ("voxpipe_requests_total", (("endpoint", endpoint), ("outcome", outcome)))
        return after[key] - before[key]

    task = rig.post(json={"text": "hi"})  # ok, three chunks
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(2048))
    await asyncio.sleep(0.6)  # far past the 0.2 s bucket, also when a loaded machine delays chunk 0
    await rig.workers.audio(req.rid, _pcm(2048), _pcm(2048), finish=FinishReason.STOP)
    assert (await (await task).read())[:4] == b"RIFF"
    assert (await rig.client.post("/generate", json={"text": ""})).status == 400  # client_error
    speech = {"model": "tts-1", "input": "hi", "response_format": "pcm"}
    assert (await rig.client.post("/v1/audio/speech", json={**speech, "speed": 2})).status == 400
    task = asyncio.create_task(rig.client.post("/v1/audio/speech", json=speech))  # server_error
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, finish=FinishReason.ERROR, status=500, message="boom")
    assert (await task).status == 500
    task = rig.post(json={"text": "bye"})  # cancelled
    await rig.workers.next_request()
    task.cancel()
    await rig.workers.next_gpu_msg()  # the Abort: the handler has finished

    after = await scrape(rig)
    assert count(after, "generate", "ok") == 1 and count(after, "generate", "client_error") == 1
    assert count(after, "generate", "cancelled") == 1 and count(after, "speech", "client_error") == 1
    assert count(after, "speech", "server_error") == 1 and count(after, "speech", "ok") == 0
    assert (
        after[("voxpipe_time_to_first_audio_seconds_count", ())]
        - before.get(("voxpipe_time_to_first_audio_seconds_count", ()), 0)
        == 1
    )
    gaps = ("voxpipe_inter_chunk_gap_seconds_count", ())
    assert after[gaps] - before.get(gaps, 0) == 2
    fast = ("voxpipe_inter_chunk_gap_seconds_bucket", (("le", "0.2"),))
    assert after[fast] - before.get(fast, 0) == 1  # one gap of >= 600 ms, one of ~0
    assert after[("voxpipe_http_requests_in_flight", (("endpoint", "generate"),))] == 0


async def test_metrics_export_the_workers_heartbeat_gauges_and_counters(rig: Rig) -> None:
    status = ProcStatus(
        name="gpu_worker",
        role="gpu_worker",
        pid=1,
        state=ProcState.READY,
        time=time.time(),
        metrics=GPU_METRICS,
    )
    await rig.workers.send(status)
    deadline = time.monotonic() + 3
    while ("voxpipe_kv_pages_used", (("process", "gpu_worker"), ("role", "gpu_worker"))) not in (
        m := await scrape(rig)
    ):
        assert time.monotonic() < deadline, "worker metrics never showed up"
        await asyncio.sleep(0.02)
    labels = (("process", "gpu_worker"), ("role", "gpu_worker"))
    for key, value in GPU_METRICS.items():
        assert m[(f"voxpipe_{key}", labels)] == value, key
    resp = await rig.client.get("/metrics")
    text = await resp.text()
    assert "# TYPE voxpipe_generated_tokens_total counter" in text
    assert "# TYPE voxpipe_kv_pages_used gauge" in text
    assert "# TYPE voxpipe_kv_pages_total gauge" in text  # a capacity, not a count of events
    # A worker that stops reporting drops out after a second instead of showing stale pages.
    await asyncio.sleep(1.1)
    assert not any(name.startswith("voxpipe_kv_pages") for name, _ in await scrape(rig))


async def test_each_app_has_its_own_registry(start_rig: Callable[..., Awaitable[Rig]]) -> None:
    one, two = await start_rig(), await start_rig()
    assert (await one.client.post("/generate", json={})).status == 400
    key = ("voxpipe_requests_total", (("endpoint", "generate"), ("outcome", "client_error")))
    assert (await scrape(one))[key] == 1 and (await scrape(two))[key] == 0
