"""The load benchmark drives a real server and reports the curve it promises."""

from __future__ import annotations

import json

import pytest

from bench.load import Result
from common.cli import main


def test_on_time_means_the_player_never_runs_dry():
    rate = 1000  # 1 byte pair = 1 ms of audio at this rate
    steady = Result(ok=True, chunks=[(0.1, 200), (0.15, 400), (0.3, 600)])  # 100 ms buffered, then 200
    assert steady.on_time(rate)
    stall = Result(ok=True, chunks=[(0.1, 200), (0.5, 400)])  # 400 ms gap after 100 ms of audio
    assert not stall.on_time(rate)
    assert not Result(ok=False).on_time(rate)


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
    assert res["max_streams_meeting_target"] in (0, 1, 3)
