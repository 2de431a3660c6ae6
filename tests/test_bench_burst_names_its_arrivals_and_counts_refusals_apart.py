"""`voxpipe bench --burst`: every client of a level starts at once (here in two client processes);
each result file names its device, its arrivals (ramp, burst or poisson) and the largest level
meeting the target; a request refused at admission (503 with Retry-After) is counted as rejected,
not as a failure, and its client waits the Retry-After before the next."""

from __future__ import annotations

import json

import pytest

from bench.load import Result, arrivals, meets_target, summarize
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
