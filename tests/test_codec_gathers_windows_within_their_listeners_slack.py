"""The codec worker gathers windows from several steps into one decode call, but never past what a
window's listener has buffered: the gpu_worker stamps each window with that slack (0 for a first
chunk), and the codec worker decodes when the earliest deadline, its longest wait or a full batch
comes. Urgent requests' windows (a first chunk, a window with less audio left than a pass takes)
go out first, on their own; a request's end goes after its last window, at once when none is
waiting."""

from __future__ import annotations

import time

import numpy as np
from test_workers_over_zmq import addrs, gateway_inbox, ready, start, wait_for  # noqa: F401

from codec_worker.gather import MARGIN_S, Gather
from common.config import CodecSettings, GpuWorkerSettings
from common.ipc import PushChannel
from common.messages import (
    AudioChunks,
    DetokBatch,
    DetokChunk,
    Finished,
    FinishReason,
    ProcStatus,
    Prompt,
    SamplingParams,
)
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class

FRAME_S = 2048 / 24000  # one Orpheus window's audio


def chunk(index: int, slack_ms: float, rid: str = "r") -> DetokChunk:
    return DetokChunk(rid, index, 1, b"", index, slack_ms=slack_ms)


def test_a_first_chunk_is_decoded_at_once():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.add(DetokBatch([chunk(0, 0.0)], []), arrived=10.0)
    assert g.due(10.0) and g.wait_ms(10.0) == 0


def test_windows_with_slack_wait_for_company_up_to_the_longest_wait():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.add(DetokBatch([chunk(3, 500.0, "a")], []), arrived=10.0)
    assert not g.due(10.0) and 29 <= g.wait_ms(10.0) <= 31
    g.add(DetokBatch([chunk(5, 400.0, "b")], []), arrived=10.010)
    assert not g.due(10.029)
    assert g.due(10.030)  # the oldest has waited max_wait
    urgent, rest, finished = g.take()
    assert urgent == [] and [c.rid for c in rest] == ["a", "b"] and finished == []
    assert not g.due(11.0) and g.wait_ms(11.0) == 100  # nothing waiting: idle polling


def test_a_tight_listener_sets_the_deadline():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.decoded(0.004)  # a decode call takes 4 ms
    g.decoded(0.001)  # a small call since does not make the next large one look cheap
    assert g.decode_s >= 0.0038
    g.add(DetokBatch([chunk(2, 500.0, "a")], []), arrived=10.0)
    g.add(DetokBatch([chunk(1, 20.0, "b")], []), arrived=10.001)  # 20 ms of audio left
    deadline = 10.001 + 0.020 - g.decode_s - MARGIN_S
    assert not g.due(deadline - 0.001) and g.due(deadline)


def test_a_full_batch_goes_at_once():
    g = Gather(max_wait_s=0.030, full_batch=3)
    g.add(DetokBatch([chunk(i, 500.0, f"r{i}") for i in range(2)], []), arrived=10.0)
    assert not g.due(10.0)
    g.add(DetokBatch([chunk(2, 500.0, "r2")], []), arrived=10.001)
    assert g.due(10.001)


def test_urgent_requests_come_first_with_their_earlier_windows():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.add(DetokBatch([chunk(4, 500.0, "a"), chunk(6, 300.0, "late")], []), arrived=10.0)
    g.add(DetokBatch([chunk(0, 0.0, "new"), chunk(7, 0.0, "late")], []), arrived=10.005)
    urgent, rest, _ = g.take()
    assert [(c.rid, c.index) for c in urgent] == [("late", 6), ("new", 0), ("late", 7)]
    assert [c.rid for c in rest] == ["a"]


def test_a_window_with_less_audio_left_than_a_pass_takes_is_urgent():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.decoded(0.040)  # a pass takes 40 ms
    tight = 1000 * (0.040 + MARGIN_S)
    g.add(DetokBatch([chunk(3, 500.0, "a"), chunk(1, tight - 1.0, "second")], []), arrived=10.0)
    urgent, rest, _ = g.take(now=10.0)
    assert [c.rid for c in urgent] == ["second"] and [c.rid for c in rest] == ["a"]
    # what its listener played while the window waited here counts against its slack
    g.add(DetokBatch([chunk(3, 500.0, "a"), chunk(2, tight + 5.0, "second")], []), arrived=20.0)
    assert [c.rid for c in g.take(now=20.0)[0]] == []
    g.add(DetokBatch([chunk(3, 500.0, "a"), chunk(2, tight + 5.0, "second")], []), arrived=20.0)
    assert [c.rid for c in g.take(now=20.006)[0]] == ["second"]


def test_an_end_waits_only_for_its_own_windows():
    g = Gather(max_wait_s=0.030, full_batch=64)
    g.add(DetokBatch([chunk(7, 500.0, "x")], []), arrived=12.0)
    ends = g.add(
        DetokBatch([], [Finished("x", FinishReason.STOP, 50, 8), Finished("y", FinishReason.ABORT)]), 12.001
    )
    assert [f.rid for f in ends] == ["y"]  # nothing of y's waits: its end goes at once
    assert not g.due(12.002)  # and x's end does not hurry the gathered windows
    assert g.due(12.030)
    _, rest, finished = g.take()
    assert [c.index for c in rest] == [7] and [f.rid for f in finished] == ["x"]


def test_the_gpu_worker_stamps_each_window_with_its_listeners_slack():
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_lm()
    eng = Engine(program, GpuWorkerSettings(max_batch_size=2, max_context=200, first_chunk="reference"))
    clock = [100.0]
    eng.windows.now = lambda: clock[0]
    rows = np.array([128259, 300, 301, 302, 128009, 128260, 128261, 128257], dtype="<i4")
    sp = SamplingParams(max_tokens=120, min_tokens=100, constrained=True, seed=3)
    eng.add(Prompt("r", rows.tobytes(), len(rows), sp))
    chunks = []
    while eng.has_work():
        clock[0] += 0.005  # 5 ms a step: 7 rows (one window, 85 ms of audio) every 35 ms
        out = eng.step()
        if out is not None:
            chunks += out.chunks
    assert len(chunks) >= 8
    assert chunks[0].slack_ms == 0.0
    # Window k leaves 35 ms after window k-1: k windows sent, k * 35 ms played.
    for k, c in enumerate(chunks[1:-1], start=1):
        assert abs(c.slack_ms - 1000 * k * (FRAME_S - 0.035)) < 1e-6, (k, c.slack_ms)


def test_the_codec_worker_sends_a_first_chunk_at_once_and_gathers_the_rest(addrs, gateway_inbox):  # noqa: F811
    # A gather long beside the three sends' ~0.1 s, so that a busy host's stalls still land them in it
    proc = start("codec_worker", addrs, codec=CodecSettings(gather_ms=1000.0))
    try:
        wait_for(gateway_inbox, ready("codec_worker"))
        rng = np.random.default_rng(0)
        codes = rng.integers(1, 4096, size=(4, 28))
        tokens = (codes + 128266 + 4096 * (np.arange(28) % 7)).astype("<i4")
        to_codec: PushChannel = PushChannel(addrs.codec_in)
        t0 = time.monotonic()
        to_codec.send(DetokBatch([DetokChunk("a", 0, 9, tokens[0].tobytes(), 0)], []))
        first = wait_for(gateway_inbox, lambda m: isinstance(m, AudioChunks))[-1]
        assert [c.rid for c in first.chunks] == ["a"] and time.monotonic() - t0 < 0.4
        # Three windows of streams with seconds of audio buffered, sent apart: one decode call.
        for i in (1, 2, 3):
            to_codec.send(
                DetokBatch([DetokChunk(f"s{i}", 4, 9, tokens[i].tobytes(), 4, slack_ms=5000.0)], [])
            )
            time.sleep(0.05)
        got = wait_for(gateway_inbox, lambda m: isinstance(m, AudioChunks))[-1]
        assert [c.rid for c in got.chunks] == ["s1", "s2", "s3"]
        assert all(len(c.pcm) == 2048 * 2 for c in got.chunks)
        # Its heartbeat counts them: 4 windows in 2 calls.
        beat = wait_for(
            gateway_inbox,
            lambda m: isinstance(m, ProcStatus) and m.metrics.get("codec_windows_total", 0) >= 4,
            timeout=10,
        )[-1]
        assert beat.metrics["codec_calls_total"] == 2 and beat.metrics["codec_busy_seconds_total"] > 0
    finally:
        proc.kill()
