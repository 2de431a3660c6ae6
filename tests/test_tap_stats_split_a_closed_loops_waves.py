"""`voxpipe bench tap-stats` splits the requests whose arrival the tap saw into waves where arrivals
pause (a closed loop's burst, then the requests its clients send as their streams end) and says, for
each, how long its admission took against its arrivals, through which steps, and how many tail
windows its streams sent before their first regular window."""

from __future__ import annotations

from bench.tap_stats import WAVE_GAP_MS, stats


def request(
    rid: str, t: float, admitted: float, first_rows: int, tails: int, regular: bool = True
) -> list[dict]:
    """One request's events: its arrival at `t` s, admission, first chunk of `first_rows` rows, then
    `tails` tail windows of a frame and (with `regular`) one regular window."""
    ev = [{"stage": "http_received", "rid": rid, "time": t}, {"stage": "received", "rid": rid, "time": t + 0.001},
          {"stage": "admitted", "rid": rid, "time": admitted},
          {"stage": "first_chunk_ready", "rid": rid, "time": admitted + 0.1, "index": 0, "tail_rows": first_rows},
          {"stage": "first_byte_sent", "rid": rid, "time": admitted + 0.2}]  # fmt: skip
    for i in range(1, tails + 1):
        ev.append(
            {
                "stage": "chunk_ready",
                "rid": rid,
                "time": admitted + 0.1 + 0.05 * i,
                "index": i,
                "tail_rows": 7,
            }
        )
    if regular:
        ev.append(
            {"stage": "chunk_ready", "rid": rid, "time": admitted + 0.5, "index": tails + 1, "tail_rows": 0}
        )
    return ev


def step(t: float, prompts: int, waiting: int, stop: str, batch: int = 100) -> dict:
    return {"stage": "step", "rid": "", "time": t, "batch": batch, "prompts": prompts, "waiting": waiting,
            "stop": stop, "wall_ms": 5.0, "withheld_ms": 0.0}  # fmt: skip


def test_a_closed_loops_burst_and_second_wave_are_summed_up_apart():
    events = []
    for i in range(3):  # the burst: three requests 10 ms apart, admitted within 50 ms of the first
        events += request(f"a{i}", 100.0 + 0.01 * i, 100.03 + 0.01 * i, first_rows=21, tails=1)
    # the second wave: its streams' next requests 0.5 s apart (one wave), the last admitted late
    events += request("b0", 102.0, 102.8, first_rows=14, tails=2)
    events += request("b1", 102.5, 103.0, first_rows=14, tails=0, regular=False)
    # a text in two segments: the second is submitted as the first ends, no arrival of its own
    events += [{"stage": "http_received", "rid": "c", "time": 102.2}]
    events += request("c/0", 102.2, 102.4, first_rows=14, tails=2)[1:]
    events += request("c/1", 103.5, 103.6, first_rows=14, tails=0)[1:]
    # ("c/0" arrives with the HTTP request "c", at 102.2 s)
    events += [step(100.035, 1, 2, "cap"), step(100.045, 1, 1, "cap")]  # the burst's admission
    events += [step(102.6, 1, 1, "room"), step(102.9, 2, 1, "room")]  # the wave's
    events += [step(102.95, 0, 1, "", batch=0), step(104.0, 1, 1, "room")]  # collected only; after it
    waves = stats(events)["waves"]
    assert len(waves) == 2
    burst, second = waves
    assert burst["requests"] == 3 and burst["admitted"] == 3
    assert burst["arrivals_over_ms"] == 20.0 and burst["last_admitted_ms"] == 50.0
    assert burst["first_chunk_rows"] == {"21": 3} and burst["tail_windows_per_stream"] == {"1": 3}
    assert burst["first_audio_ms"]["p50"] == 230.0  # arrival → first byte sent, each 230 ms
    assert burst["steps_with_prompts_waiting"] == 2 and burst["stops"] == {"cap": 2}
    assert second["requests"] == 3 and second["admitted"] == 3
    assert second["arrivals_over_ms"] == 500.0 and second["last_admitted_ms"] == 1000.0
    assert second["first_chunk_rows"] == {"14": 3}
    assert second["tail_windows_per_stream"] == {"0": 1, "2": 2}  # b1 ended before any tail window
    assert second["steps_with_prompts_waiting"] == 2 and second["prompts_they_start"] == 3
    assert second["one_prompt_steps"] == 1 and second["stops"] == {"room": 2}
    assert second["first_audio_ms"]["p99"] == 1000.0  # b0: its admission waited 800 ms


def test_arrivals_closer_than_the_gap_are_one_wave():
    events = []
    for i in range(5):  # arrivals just within the gap of each other: one wave, however long
        t = 100.0 + i * (WAVE_GAP_MS - 1) / 1000
        events += request(f"r{i}", t, t + 0.01, first_rows=7, tails=0)
    (wave,) = stats(events)["waves"]
    assert wave["requests"] == 5 and wave["steps_with_prompts_waiting"] == 0
    assert wave["arrivals_over_ms"] == 4 * (WAVE_GAP_MS - 1)
