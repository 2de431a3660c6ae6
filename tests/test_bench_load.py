"""The load benchmark drives a real server and reports the curve it promises."""

from __future__ import annotations

import json
import math

import pytest

from bench.load import (
    Result,
    auth_headers,
    connect_summary,
    measure_level,
    run_level_parts,
    start_parts,
    summarize,
)
from common.cli import main


def test_on_time_means_the_player_never_runs_dry():
    rate = 1000  # 1 byte pair = 1 ms of audio at this rate
    steady = Result(ok=True, chunks=[(0.1, 200), (0.15, 400), (0.3, 600)])  # 100 ms buffered, then 200
    assert steady.on_time(rate)
    stall = Result(ok=True, chunks=[(0.1, 200), (0.5, 400)])  # 400 ms gap after 100 ms of audio
    assert not stall.on_time(rate)
    assert not Result(ok=False).on_time(rate)


def test_lateness_says_how_far_behind_and_when():
    sr = 24000
    chunk = 2 * 2400  # 0.1 s of PCM16 per chunk
    on_time = Result(ok=True, chunks=[(0.2, chunk), (0.25, 2 * chunk), (0.35, 3 * chunk)])
    worst, first = on_time.lateness(sr)
    assert worst == 0.0 and math.isnan(first) and on_time.on_time(sr)
    # Chunk 3 comes 0.5 s after the first with 0.2 s received: 0.3 s behind, first late at 0.5 s.
    starved = Result(ok=True, chunks=[(0.2, chunk), (0.3, 2 * chunk), (0.7, 3 * chunk), (0.75, 4 * chunk)])
    worst, first = starved.lateness(sr)
    assert abs(worst - 0.3) < 1e-9 and abs(first - 0.5) < 1e-9 and not starved.on_time(sr)


def test_a_level_says_which_requests_came_late_and_first_audio_by_the_second_sent():
    sr = 24000
    chunk = 2 * 2400  # 0.1 s of PCM16 per chunk
    starved = Result(ok=True, ttfa=0.2, sent_at=7.4, rid="late-one",
                     chunks=[(0.2, chunk), (0.3, 2 * chunk), (0.7, 3 * chunk), (0.75, 4 * chunk)])  # fmt: skip
    fine = [Result(ok=True, ttfa=0.1 + 0.01 * i, sent_at=0.5 * i, chunks=[(0.1, chunk), (0.15, 2 * chunk)])
            for i in range(4)]  # fmt: skip
    failed = Result(ok=False, error="HTTP 503: busy", sent_at=1.0)
    out = summarize([starved, *fine, failed], wall_s=10.0, sample_rate=sr)
    assert out["late_requests"] == 1 and out["errors"] == 1
    assert out["late_examples"] == [
        {"rid": "late-one", "sent_at_s": 7.4, "ttfa_ms": 200.0, "first_chunk_audio_ms": 100.0,
         "first_late_chunk": 2, "first_late_at_s": 0.5, "worst_late_ms": 300.0, "chunks": 4}
    ]  # fmt: skip
    by = out["ttfa_by_sent_second"]  # sent at 0, 0.5, 1.0, 1.5 and 7.4 s
    assert by["t_s"] == [0, 1, 7] and by["n"] == [2, 2, 1]
    assert by["max_ms"] == [110.0, 130.0, 200.0]


def test_the_bench_sends_the_servers_key_when_it_has_one(monkeypatch):
    monkeypatch.delenv("VOXPIPE_API_KEY", raising=False)
    assert auth_headers() == {}
    monkeypatch.setenv("VOXPIPE_API_KEY", "s3cret")
    assert auth_headers() == {"Authorization": "Bearer s3cret"}


def test_load_levels_report_ttfa_viability_and_throughput(server, tmp_path):
    out = tmp_path / "load.json"
    argv = ["bench", "--url", server.base, "--concurrency", "1,3", "--duration", "3", "--tokens", "60"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--out", str(out)])  # `voxpipe bench …`
    assert done.value.code == 0
    res = json.loads(out.read_text())
    assert [p["concurrency"] for p in res["curve"]] == [1, 3]
    for point in res["curve"]:
        assert point["requests"] >= point["concurrency"] and point["errors"] == 0
        assert 0 < point["ttfa_p50_ms"] <= point["ttfa_p99_ms"]
        assert 0.0 <= point["on_time_share"] <= 1.0 and point["x_realtime"] > 0
        assert point["late_requests"] <= point["requests"]
        assert 0 <= point["client_loop_lag_max_ms"] < 10_000  # the client's own loop, watched
        # the streams the gateway saw fall behind playback on its side, read from its /metrics
        assert 0 <= point["server_streams_behind"] <= point["requests"], point
        # each client opened its connection (a closed loop reuses it) within the level, none retried
        assert point["concurrency"] <= point["connects"] <= point["requests"], point
        assert point["connects_retried"] == 0 and 0 < point["connect_p99_ms"] < 900
        # every request went out, after its connection opened and before its first audio came
        assert point["connect_p99_ms"] / 10 < point["send_ms_p99"] < point["ttfa_p99_ms"], point
        assert 0 < point["send_ms_p50"] <= point["send_ms_p99"]
    # The server's gauges, sampled every 2 s while the levels ran (3 s each, plus the drain).
    during = [p["server_during"] for p in res["curve"]]
    busy = [d for d in during if d["samples"] > 0]
    assert busy, during
    for d in busy:
        assert d["max_decode_batch_size"] >= 1 and d["stream_capacity"] > 0 and "step_host_ms" in d
        assert d["min_stream_capacity"] <= d["stream_capacity_p10"] <= d["stream_capacity"]
        assert 0.0 <= d["admission_queued_share"] <= 1.0
        assert 0.0 <= d["gateway_loop_lag_max_ms"] < 10_000  # the gateway's loop, in ms
    assert any(d.get("codec_windows_per_call", 0) >= 1 for d in during), during
    assert res["max_streams_meeting_target"] in (0, 1, 3)


def test_a_level_split_over_client_processes_starts_them_together(server):
    """`--client-procs 2`: a burst's clients, and a Poisson rate, run in two processes started at
    once; their results come back as one level's."""
    level = {"duration": 1.5, "tokens": 60, "prompt_allowance": 100, "seed": 3}
    lags: list[float] = []
    burst, wall = run_level_parts(start_parts(server.base, 2, {**level, "concurrency": 4}), lags)
    assert len(lags) == 2 and all(0 <= lag < 10 for lag in lags)  # each process's loop, watched
    assert wall >= 1.5 and all(r.ok and r.chunks for r in burst), [r.error for r in burst]
    assert len({r.rid for r in burst}) == len(burst) >= 4
    parts = {r.rid.split("-")[2] for r in burst}  # load-<level>-<part>-<n>
    assert parts == {"0", "1"}, parts
    first = sorted(r.sent_at for r in burst)[:4]  # every client's first request at the level's start
    assert 0 <= first[0] and first[-1] < 0.3, first
    poisson, _ = run_level_parts(start_parts(server.base, 2, {**level, "rate": 2.0}))
    assert {r.rid.split("-")[2] for r in poisson} == {"0", "1"} and all(r.ok for r in poisson)
    point = measure_level(server.base, 24000, client_procs=2, concurrency=2, **level)
    assert point["client_procs"] == 2 and point["errors"] == 0 and point["requests"] >= 2
    assert point["client_loop_lag_max_ms"] >= 0


def test_a_part_of_a_level_runs_its_clients_its_rate_and_its_share_of_errors(monkeypatch):
    """`run_level`'s part (p, k) without a server: the clients i % k == p at their place in the
    ramp from the shared start, a Poisson stream of rate / k, the part's share of `max_errors`."""
    import asyncio
    import time

    import bench.load as load

    sends: list[float] = []

    async def request(session, url, body, since, rid, ok=True, hold=1.0):
        sends.append(time.perf_counter())
        await asyncio.sleep(hold)  # each client sends once within the level
        return Result(ok=ok, rid=rid, sent_at=sends[-1] - since)

    def run(**level):
        sends.clear()
        start = time.perf_counter() + 0.2
        common = {"tokens": 10, "prompt_allowance": 10, "seed": 1, "start_at": start}
        results, _ = asyncio.run(load.run_level("http://127.0.0.1:9", **common, **level))
        return start, results

    monkeypatch.setattr(load, "one_request", request)
    start, results = run(concurrency=4, duration=1.0, ramp=1.0, part=(1, 2))  # clients 1 and 3
    offsets = [t - start for t in sends]
    assert len(results) == 2 and abs(offsets[0] - 0.25) < 0.1 and abs(offsets[1] - 0.75) < 0.1, offsets
    monkeypatch.setattr(load, "one_request", lambda *a: request(*a, hold=0.0))
    counts = []
    for p in (0, 1):
        start, results = run(rate=60.0, duration=1.0, part=(p, 2))  # 30 req/s each
        counts.append(len(results))
        assert (sends[0] - start < 0.02) == (p == 0)  # one first request at the start, not two
    assert 35 <= sum(counts) <= 95, counts  # ~60 (120 were each part at the whole rate)
    monkeypatch.setattr(load, "one_request", lambda *a: request(*a, ok=False, hold=0.0))
    _, results = run(concurrency=1, duration=5.0, max_errors=3, part=(0, 2))
    assert len(results) == 2  # its share of 3 failures: 2


def test_bench_commands_run_their_module_and_an_unknown_one_is_refused(tmp_path, capsys):
    from bench.cli import COMMANDS

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in COMMANDS)
    tap = tmp_path / "tap.jsonl"
    tap.write_text("")
    out = tmp_path / "stats.json"
    with pytest.raises(SystemExit) as done:
        main(["bench", "tap-stats", str(tap), "--out", str(out)])  # a command's own arguments
    assert done.value.code == 0 and isinstance(json.loads(out.read_text()), dict)
    with pytest.raises(SystemExit) as done:
        main(["bench", "no-such-bench"])
    assert done.value.code == 2 and "unknown command" in capsys.readouterr().err


def test_a_level_counts_the_connects_that_waited_for_a_syn_retry():
    results = [Result(ok=True, connect_s=c, send_s=c + 0.001) for c in (0.0, 0.012, 0.015, 1.04, 0.0)]
    assert connect_summary(results) == {
        "connects": 3,
        "connect_p99_ms": 1040.0,
        "connects_retried": 1,
        "send_ms_p50": 13.0,
        "send_ms_p99": 1041.0,
    }
    assert connect_summary([Result(ok=True)]) == {
        "connects": 0,
        "connect_p99_ms": None,
        "connects_retried": 0,
        "send_ms_p50": None,
        "send_ms_p99": None,
    }
