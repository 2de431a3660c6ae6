"""`voxpipe bench gateway` against a real server on this host: bursts at two token budgets, the
gateway's CPU time from its CPU-time clock, the audio each request got and the event loop's lag over each
burst, in a result that names its commit and command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

from bench.cli import main as bench_main
from bench.gateway_cost import cpu_s


def test_bursts_at_two_budgets_give_the_gateways_cost_per_request_and_per_audio_second(server, tmp_path):
    out = tmp_path / "gateway.json"
    argv = ["gateway", "--url", server.base, "--clients", "24", "--rounds", "1", "--pause", "0.5"]
    assert bench_main([*argv, "--max-tokens", "30,90", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["commit"] and res["command"].startswith("'voxpipe bench gateway' --url")
    assert [r["max_tokens"] for r in res["rounds"]] == [30, 90]
    audio = res["audio_s_per_request"]
    assert audio["30"] == 0.0 and audio["90"] > 0.5  # 3 tokens: no frame; 63: seconds of audio
    assert all(r["gateway_cpu_s"] >= 0 and r["loop_lag_max_ms"] >= 0 for r in res["rounds"])
    # the requests' share: the round's CPU less the idle gateway's (timed in the pause) over its wall
    for r in res["rounds"]:
        assert r["idle_cpu_ms_per_s"] > 0  # heartbeats, timers: an idle gateway is never at zero
        expect = r["gateway_cpu_s"] - r["idle_cpu_ms_per_s"] / 1000 * r["wall_s"]
        assert abs(r["requests_cpu_s"] - max(0.0, expect)) <= 0.002
    assert 0 < res["idle_cpu_ms_per_s"] < 200
    assert res["cpu_ms_per_request"]["30"] >= 0 and math.isfinite(res["cpu_ms_per_audio_second"])


def test_another_processs_cpu_time_is_read_to_well_under_a_clock_tick():
    # A child that spins 0.3 s of CPU, then sleeps: its CPU time as this process reads it
    spin = (
        "import time\nprint(1, flush=True)\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\nprint(2, flush=True)\ntime.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "1"
        spinning = []
        for _ in range(3):
            spinning.append(cpu_s(child.pid))
            time.sleep(0.03)
        assert child.stdout.readline().strip() == "2"
        done = cpu_s(child.pid)
        time.sleep(0.05)
        assert cpu_s(child.pid) - done < 0.005  # asleep: no CPU
        assert 0.3 <= done < 0.8 and spinning == sorted(spinning) and spinning[-1] > spinning[0]
        # /proc's times come in 10 ms ticks; a CPU-time clock's in ns
        assert any(abs(100 * v - round(100 * v)) > 1e-6 for v in [*spinning, done]), spinning
    finally:
        child.kill()
        child.wait()
