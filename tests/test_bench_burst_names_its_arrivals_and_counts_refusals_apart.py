"""`voxpipe bench --burst`: every client of a level starts at once (here in two client processes);
each result file names its device, its arrivals (ramp, burst or poisson) and the largest level
meeting the target; a burst level gives the burst's own first audio apart from the closed loop's
later requests (`burst_wave`, `after_burst`); a request refused at admission (503 with Retry-After) is counted as rejected,
not as a failure, and its client waits the Retry-After before the next."""

from __future__ import annotations

import json

import pytest

from bench.load import Result, arrivals, burst_waves, meets_target, summarize
from common.cli import main


def test_a_burst_level_sends_every_clients_first_request_at_once(server, tmp_path, monkeypatch):
    monkeypatch.setenv("VOXPIPE_COMMIT", "abc1234")  # a copied tree names its commit so
    out = tmp_path / "burst.json"
    argv = [
        "bench",
        "--url",
        server.base,
        "--concurrency",
        "4",
        "--burst",
        "--duration",
        "2",
        "--tokens",
        "40",
        "--client-procs",
        "2",
    ]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--device", "test-cpu", "--out", str(out)])
    assert done.value.code == 0
    res = json.loads(out.read_text())
    assert res["arrivals"] == "burst" and res["device"] == "test-cpu" and res["ramp_s"] == 0.0
    assert res["commit"] == "abc1234"
    assert "--burst" in res["command"] and "max_streams_meeting_target" in res
    (point,) = res["curve"]
    assert point["arrivals"] == "burst" and point["errors"] == 0 and point["rejected"] == 0
    assert point["client_procs"] == 2  # two clients in each of two processes, started together
    by = point["ttfa_by_sent_second"]
    assert by["t_s"][0] == 0 and by["n"][0] >= 4  # the four first requests went out in second 0
    wave, after = point["burst_wave"], point["after_burst"]
    assert wave["requests"] == 4 and after["requests"] == point["requests"] - 4
    assert wave["on_time_share"] is not None and wave["ttfa_p99_ms"] > 0


def test_a_bursts_own_first_audio_is_told_from_the_waves_after_it():
    sr, chunk = 24000, 2 * 2400
    # three clients: their first requests at 0 s (TTFA 0.2 s), then a second wave at 5 s that waits
    # longer (TTFA 0.9 s), one of its streams late at its second chunk
    first = [
        Result(ok=True, ttfa=0.2, sent_at=0.001 * i, chunks=[(0.2, chunk), (0.25, 2 * chunk)])
        for i in range(3)
    ]
    second = [
        Result(ok=True, ttfa=0.9, sent_at=5.0 + 0.01 * i, chunks=[(0.9, chunk), (0.95, 2 * chunk)])
        for i in range(2)
    ]
    second.append(Result(ok=True, ttfa=0.9, sent_at=5.2, chunks=[(0.9, chunk), (1.2, 2 * chunk)]))
    out = burst_waves([*second, *first], clients=3, sample_rate=sr)  # in any order
    assert out["burst_wave"] == {
        "requests": 3,
        "ttfa_p50_ms": 200.0,
        "ttfa_p99_ms": 200.0,
        "on_time_share": 1.0,
    }
    assert out["after_burst"]["requests"] == 3 and out["after_burst"]["ttfa_p99_ms"] == 900.0
    assert out["after_burst"]["on_time_share"] == round(2 / 3, 4)
    assert burst_waves(first, clients=3, sample_rate=sr)["after_burst"]["requests"] == 0


def test_arrivals_are_named_by_how_a_level_starts():
    assert (
        arrivals(True, 0.0) == "poisson"
        and arrivals(False, 8.0) == "ramp"
        and arrivals(False, 0.0) == "burst"
    )


def test_refusals_at_admission_are_neither_failures_nor_on_time():
    sr, chunk = 24000, 2 * 2400
    served = [
        Result(ok=True, ttfa=0.1, sent_at=0.1 * i, chunks=[(0.1, chunk), (0.15, 2 * chunk)]) for i in range(3)
    ]
    refused = [Result(error="HTTP 503: at capacity", retry_after_s=2.0) for _ in range(2)]
    failed = Result(error="HTTP 500: broken")
    out = summarize([*served, *refused, failed], wall_s=5.0, sample_rate=sr)
    assert out["rejected"] == 2 and out["errors"] == 1 and out["error_examples"] == ["HTTP 500: broken"]
    assert out["on_time_share"] == 0.5 and out["on_time_share_admitted"] == 0.75
    clean = summarize(served, wall_s=5.0, sample_rate=sr)
    assert meets_target(clean)
    assert not meets_target({**clean, "rejected": 1})  # past capacity: not a level that meets the target
