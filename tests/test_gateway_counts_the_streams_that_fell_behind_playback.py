"""The gateway counts the streamed requests whose audio fell behind playback on its side
(`voxpipe_stream_behind_seconds`): from a stream's first audio, a later piece that comes after the
audio before it has played out. A stream whose pieces keep ahead is not counted, nor a whole
(non-streaming) response, which nobody plays while it comes. Real gateway over HTTP and ZMQ, the
test playing the workers (`tests.test_gateway.FakeWorkers`)."""

from __future__ import annotations

import asyncio

from common.messages import FinishReason
from tests.test_admission_queues_then_refuses_with_retry_after import make_rig  # noqa: F401
from tests.test_gateway import SAMPLE_RATE, _pcm


async def played(rig, streaming: bool, first_s: float, pause_s: float) -> None:
    """A request whose first `first_s` of audio comes, then after `pause_s` 0.1 s more and its end."""
    task = rig.post("/generate", text="hi", streaming=streaming)
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(round(first_s * SAMPLE_RATE)))
    await asyncio.sleep(pause_s)
    await rig.workers.audio(req.rid, _pcm(SAMPLE_RATE // 10), finish=FinishReason.STOP)
    resp = await task
    assert resp.status == 200
    await resp.read()


async def test_a_stream_whose_audio_came_after_playback_ran_dry_is_counted_by_how_far(make_rig):  # noqa: F811
    rig = await make_rig()
    assert await rig.metric("voxpipe_stream_behind_seconds_count") == 0
    await played(rig, streaming=True, first_s=0.1, pause_s=0.35)  # ~0.25 s behind
    assert await rig.metric("voxpipe_stream_behind_seconds_count") == 1
    behind = await rig.metric("voxpipe_stream_behind_seconds_sum")
    assert 0.2 <= behind < 5, behind
    assert await rig.metric('voxpipe_stream_behind_seconds_bucket{le="0.2"}') == 0

    await played(rig, streaming=True, first_s=2.0, pause_s=0.05)  # 2 s in hand: far ahead
    await played(rig, streaming=False, first_s=0.1, pause_s=0.35)  # a whole file: not played as it comes
    assert await rig.metric("voxpipe_stream_behind_seconds_count") == 1
    assert await rig.metric('voxpipe_requests_total{endpoint="generate",outcome="ok"}') == 3
