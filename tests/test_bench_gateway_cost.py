"""`voxpipe bench gateway` against a real server on this host: bursts at two token budgets, the
gateway's CPU time read from /proc, the audio each request got and the event loop's lag over each
burst, in a result that names its commit and command."""

from __future__ import annotations

import json
import math

from bench.cli import main as bench_main


def test_bursts_at_two_budgets_give_the_gateways_cost_per_request_and_per_audio_second(server, tmp_path):
    out = tmp_path / "gateway.json"
    argv = ["gateway", "--url", server.base, "--clients", "24", "--rounds", "1", "--pause", "0"]
    assert bench_main([*argv, "--max-tokens", "30,90", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["command"].startswith("'voxpipe bench gateway' --url")
    assert [r["max_tokens"] for r in res["rounds"]] == [30, 90]
    audio = res["audio_s_per_request"]
    assert audio["30"] == 0.0 and audio["90"] > 0.5  # 3 tokens: no frame; 63: seconds of audio
    assert all(r["gateway_cpu_s"] >= 0 and r["loop_lag_max_ms"] >= 0 for r in res["rounds"])
    assert res["cpu_ms_per_request"]["30"] >= 0 and math.isfinite(res["cpu_ms_per_audio_second"])
