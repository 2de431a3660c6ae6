"""`voxpipe bench` with its defaults works against the served model: it reads the model's limits
from `GET /v1/models`, says per level on stderr what it runs, and when requests fail it stops and
exits non-zero instead of hammering the server and reporting a curve."""

from __future__ import annotations

import json

import pytest

from bench.load_cli import fit_tokens
from common.cli import main


def test_tokens_fit_within_the_models_budget() -> None:
    assert fit_tokens(1024, 100, 400) == 300  # the default against orpheus-tiny
    assert fit_tokens(60, 100, 400) == 60
    assert fit_tokens(1024, 100, 0) == 1024  # a server that states no limit
    with pytest.raises(ValueError, match="leaves no tokens"):
        fit_tokens(1024, 400, 400)


def test_defaults_against_the_served_model_give_a_curve_without_errors(server, tmp_path, capsys) -> None:
    out = tmp_path / "load.json"
    argv = ["bench", "--url", server.base, "--duration", "2", "--progress", "1", "--out", str(out)]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    res = json.loads(out.read_text())
    assert res["tokens_per_request"] == 300 and res["model"] == "orpheus-tiny" and not res["failed"]
    (point,) = res["curve"]
    assert point["concurrency"] == 1 and point["requests"] >= 1 and point["errors"] == 0
    assert point["x_realtime_per_stream_p50"] > 0
    err = capsys.readouterr().err
    assert "max_tokens 400, so 300 tokens per request" in err
    assert "level 1/1: concurrency 1 for 2 s" in err and "x real time per stream" in err


def test_failing_requests_stop_the_run_with_a_non_zero_status(server, tmp_path, capsys) -> None:
    # A negative allowance asks for min_tokens above max_tokens: the server refuses every request.
    out = tmp_path / "load.json"
    argv = ["bench", "--url", server.base, "--concurrency", "2,4", "--duration", "30", "--tokens", "50"]
    with pytest.raises(SystemExit) as done:
        main([*argv, "--prompt-allowance", "-10", "--max-errors", "3", "--out", str(out)])
    assert done.value.code == 1
    res = json.loads(out.read_text())
    assert res["failed"] and len(res["curve"]) == 1  # the second level never ran
    point = res["curve"][0]
    assert 3 <= point["errors"] <= 3 + 2 and point["wall_s"] < 10  # ended early, not after 30 s
    assert "requests failed at concurrency 2, stopping: HTTP 400" in capsys.readouterr().err
