"""A chunk's tap event carries the slack the gpu_worker stamped on it (its listener's audio in hand
when it left), and bench/tap_stats.py counts the chunks that fell behind: left with none in hand (at
the gpu_worker: the steps made it late) or left in time and decoded slower than the slack it had (at
the codec). What leaves with a request's first audible chunk is not counted."""

from __future__ import annotations

from bench.tap_stats import stats
from common.messages import AudioChunk, AudioChunks, DetokBatch, DetokChunk, TapHeader
from common.tap import events_of


def chunk(
    rid: str, index: int, ready_s: float, slack_ms: float, codec_ms: float, samples: int = 2048, tail: int = 0
) -> list:
    """A chunk's two tap events: ready at the gpu_worker with its slack (a tail window of `tail`
    rows), decoded `codec_ms` later."""
    return [
        {"stage": "first_chunk_ready" if index == 0 else "chunk_ready", "rid": rid, "time": ready_s,
         "index": index, "slack_ms": slack_ms, "tail_rows": tail},
        {"stage": "first_chunk_decoded" if index == 0 else "chunk_decoded", "rid": rid,
         "time": ready_s + codec_ms / 1000, "index": index, "samples": samples},
    ]  # fmt: skip


def test_chunks_behind_at_the_gpu_worker_and_at_the_codec_are_told_apart():
    events = []
    for i in range(10):  # on time: 80 ms in hand, decoded in 10
        events += chunk("ok", i, 1.0 + 0.085 * i, 0.0 if i == 0 else 80.0, 10.0)
    events += chunk("late", 0, 5.0, 0.0, 10.0)
    events += chunk("late", 1, 5.085, 60.0, 10.0)
    events += chunk("late", 2, 5.17, 0.0, 10.0, tail=7)  # the steps made it after the listener ran out
    events += chunk("late", 3, 5.255, 30.0, 45.0)  # in time, but the codec took 45 ms of 30
    out = stats(events)["chunks_behind"]
    assert out["counted"] == 9 + 3  # every chunk after a request's first
    assert out["requests_behind"] == 1
    assert out["at_gpu_worker"] == 1 and out["at_codec"] == 1
    assert out["tail_windows_at_gpu_worker"] == 1 and out["tail_windows_at_codec"] == 0
    assert out["at_gpu_worker_since_first_ms"]["p50"] == 170.0
    assert out["at_codec_codec_ms"]["p50"] == 45.0
    assert out["at_codec_since_first_ms"]["p50"] == 255.0
    assert out["slack_ms"]["max"] == 80.0


def test_second_chunks_codec_time_against_the_slack_they_left_with():
    events = []
    for i in range(10):  # the second chunk leaves with 40 ms in hand; the codec takes 3 to 21 ms
        events += chunk(f"r{i}", 0, 1.0 + i, 0.0, 5.0)
        events += chunk(f"r{i}", 1, 1.06 + i, 40.0, 3.0 + 2 * i, tail=7)
        events += chunk(f"r{i}", 2, 1.12 + i, 70.0, 4.0)
    out = stats(events)
    second = out["second_chunks"]
    assert second["slack_ms"]["p50"] == 40.0 and second["codec_ms"]["max"] == 21.0
    assert second["spare_ms_min"] == 19.0 and second["spare_ms"]["max"] == 37.0
    by_index = out["codec_ms_by_chunk_index"]
    assert set(by_index) == {"0", "1", "2"} and by_index["0"]["p50"] == 5.0 and by_index["2"]["max"] == 4.0
    assert stats(chunk("a", 0, 1.0, 0.0, 5.0))["second_chunks"] == {}


def test_windows_that_leave_with_the_first_audible_one_are_not_counted():
    # a silent window first (no samples), then held windows leaving with the first audible one
    events = chunk("h", 0, 1.0, 0.0, 5.0, samples=0)
    for i in (1, 2, 3):
        events += chunk("h", i, 1.2, 0.0, 5.0)
    events += chunk("h", 4, 1.3, 90.0, 5.0)
    out = stats(events)["chunks_behind"]
    assert out["counted"] == 1 and out["at_gpu_worker"] == 0 and out["at_codec"] == 0


def test_no_slack_recorded_nothing_counted():
    events = [
        {k: v for k, v in e.items() if k != "slack_ms"}
        for e in chunk("a", 0, 1.0, 0, 5) + chunk("a", 1, 2.0, 0, 5)
    ]
    assert stats(events)["chunks_behind"] == {}


def test_the_tap_event_of_a_chunk_carries_its_slack():
    header = TapHeader(proc="gpu_worker", time=3.0)
    batch = DetokBatch(chunks=[DetokChunk("r", 4, 1, b"", tail_rows=7, slack_ms=41.234)], finished=[], step=7)
    (ready,) = events_of(header, batch)
    assert ready["stage"] == "chunk_ready" and ready["index"] == 4 and ready["slack_ms"] == 41.23
    assert ready["tail_rows"] == 7
    decoded = events_of(
        TapHeader(proc="codec_worker", time=3.01), AudioChunks(chunks=[AudioChunk("r", 4, b"\0" * 8)])
    )
    assert decoded[0]["samples"] == 4
