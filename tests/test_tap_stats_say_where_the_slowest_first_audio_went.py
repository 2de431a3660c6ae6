"""bench/tap_stats.py: beside each stage's percentiles over all requests, the slowest 5 % of the
requests' first audio stage by stage (each stage's median among them), so that a tail shows which
stage holds it."""

from __future__ import annotations

from bench.tap_stats import FIRST, stats


def request(rid: str, t0: float, stages_ms: list[float], http_ms: float | None = None) -> list[dict]:
    """Tap events of one request: its FIRST stages `stages_ms` apart (ms), from `t0` (s)."""
    events, t = [], t0
    if http_ms is not None:
        events.append({"stage": "http_received", "rid": rid, "time": t0 - http_ms / 1000})
    for stage, dt in zip(FIRST, [0.0, *stages_ms], strict=True):
        t += dt / 1000
        events.append({"stage": stage, "rid": rid, "time": t})
    return events


def test_the_slowest_requests_show_the_stage_that_holds_the_tail():
    quick = [2.0, 5.0, 15.0, 50.0, 10.0, 1.0]
    events = []
    for i in range(38):  # most requests: ~83 ms, admitted at once
        events += request(f"q{i}", float(i), quick, http_ms=1.0)
    # two waited 600 ms for admission (a burst's last), one of them also decoded slowly
    events += request("w0", 100.0, [2.0, 600.0, 15.0, 50.0, 10.0, 1.0], http_ms=300.0)
    events += request("w1", 101.0, [2.0, 600.0, 15.0, 50.0, 40.0, 1.0], http_ms=300.0)
    out = stats(events)
    assert out["first_audio_complete"] == 40
    tail = out["first_audio_tail_ms"]
    assert tail["n"] == 2  # 5 % of 40
    assert tail["prompt_built->admitted"] == 600.0
    assert tail["first_chunk_ready->first_chunk_decoded"] == 25.0  # the median of 10 and 40
    assert tail["http_received->received"] == 300.0
    assert tail["total"] == 693.0
    # over all requests the admission stage's p50 says nothing of it
    assert out["first_audio_ms"]["prompt_built->admitted"]["p50"] == 5.0


def test_no_request_complete_no_tail():
    assert stats(request("a", 0.0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])[:-1])["first_audio_tail_ms"] == {}


def test_the_timeline_says_when_a_burst_reached_each_stage():
    """A burst of 20: handlers start 5 ms apart, each prompt is admitted 3 ms after it is built, and
    every first chunk (of 21 rows) comes out 400 ms after the first arrival: the timeline gives each
    stage's first, median and last time from the first handler's start."""
    events = []
    for i in range(20):
        t0 = 10.0 + 0.005 * i  # the handler starts at t0 - 1 ms
        events += request(f"b{i}", t0, [1.0, 3.0, 20.0, 0.0, 10.0, 1.0], http_ms=1.0)
    for e in events:  # every first chunk at once
        if e["stage"] == "first_chunk_ready":
            e["time"], e["tail_rows"], e["index"] = 10.399, 21, 0
    out = stats(events)
    line = out["stage_timeline_ms"]
    assert list(line)[0] == "http_received" and line["http_received"]["first"] == 0.0
    assert line["http_received"]["last"] == 95.0
    assert line["admitted"]["first"] == 5.0 and line["admitted"]["last"] == 100.0
    assert line["first_chunk_ready"]["first"] == line["first_chunk_ready"]["last"] == 400.0
    assert out["first_chunk_rows"] == {"21": 20}
    assert stats([])["stage_timeline_ms"] == {}


def test_a_bursts_timeline_is_its_first_wave():
    """A closed loop's burst of 4, then each client's next request 5 s later: given the burst's
    size the timeline covers the four that came at once, not the wave after them."""
    events = []
    for i in range(4):
        events += request(f"b{i}", 10.0 + 0.01 * i, [1.0, 3.0, 20.0, 0.0, 10.0, 1.0], http_ms=1.0)
        events += request(f"n{i}", 15.0 + 0.5 * i, [1.0, 3.0, 20.0, 0.0, 10.0, 1.0], http_ms=1.0)
    burst = stats(events, wave=4)
    assert burst["timeline_requests"] == 4 and burst["first_audio_complete"] == 8
    assert burst["stage_timeline_ms"]["http_received"]["last"] == 30.0
    both = stats(events)
    assert both["timeline_requests"] == 8 and both["stage_timeline_ms"]["http_received"]["last"] == 6500.0
