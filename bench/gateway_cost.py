"""The gateway's own CPU time: per request, and per second of audio it streams, against a running
server on this host (its gateway's CPU time from its CPU-time clock). Every round sends `--clients`
requests at once and reads each to its end; a round at each `--max-tokens` budget (prompt included:
the smallest leaves no room for audio, the largest makes seconds of it). From the rounds: the
gateway's CPU per request with the least audio, and the slope per second of audio between the
budgets, which bounds the streams one gateway process can carry (one event loop, one core), each
round's CPU less what the idle gateway takes over as long (its heartbeats, timers and process watch,
timed in the pause before the round); and
the largest lag of its event loop over each burst (`voxpipe_gateway_loop_lag_max_seconds`): its
longest stretch of work without a turn for its timers.

    voxpipe bench gateway --url http://127.0.0.1:8000 --clients 400 --max-tokens 30,250 [--rounds 5]

The CPU time includes what the workers' replies cost the gateway (receiving, routing, writing), not
the workers' own; the server may serve any model (orpheus-tiny on a CPU is enough: the gateway does
not see the model's size).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import json
import math
import os
import statistics
import sys
import time

import aiohttp
import numpy as np

from bench.load import auth_headers, server_gauges
from bench.provenance import command, commit

TEXT = "Hello there, how are you today?"  # one text: the gateway does the same work for any
WAV_HEADER = 44


def gateway_pid(url: str) -> int:
    """The gateway's pid from /ready's process table (it must run on this host)."""
    import urllib.request

    with urllib.request.urlopen(
        urllib.request.Request(url + "/ready", headers=auth_headers()), timeout=5
    ) as r:
        rows = json.load(r)["processes"]
    pid = next(row["pid"] for row in rows if row["role"] == "gateway")
    if not os.path.exists(f"/proc/{pid}/stat"):
        raise SystemExit(f"the gateway (pid {pid}) is not on this host: run the bench beside it")
    return int(pid)


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far, every thread's (ZMQ's I/O thread too): from its CPU-time
    clock (`clock_getcpuclockid`, to the nanosecond), else /proc's user + system time (in clock
    ticks: 10 ms, a few percent of a round of a few hundred requests)."""
    clock = _cpu_clock(pid)
    if clock is not None:
        with contextlib.suppress(OSError):
            return time.clock_gettime(clock)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@functools.lru_cache(maxsize=8)
def _cpu_clock(pid: int) -> int | None:
    """Process `pid`'s CPU-time clock id (POSIX clock_getcpuclockid), None where libc has none;
    looked up once a pid (finding libc runs ldconfig), not at every reading."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        clock = ctypes.c_int()
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return clock.value


async def one(session: aiohttp.ClientSession, url: str, max_tokens: int) -> float:
    """One streamed request to its end → seconds of audio (PCM16 mono WAV)."""
    body = {"text": TEXT, "max_tokens": max_tokens}
    async with session.post(url + "/generate", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        data = await r.read()
    rate = int.from_bytes(data[24:28], "little")
    return max(0, len(data) - WAV_HEADER) / 2 / rate


async def run(args) -> dict:
    url = args.url.rstrip("/")
    pid = gateway_pid(url)
    budgets = [int(x) for x in args.max_tokens.split(",")]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, headers=auth_headers()) as session:
        await asyncio.gather(*(one(session, url, budgets[-1]) for _ in range(4)))  # warm
        rounds = []
        for _ in range(args.rounds):
            for budget in budgets:
                # the pause keeps the lag window's last burst apart from this one, and times the idle
                # gateway's own CPU (heartbeats, its timers, its process watch) to take off the round's
                c0, t0 = cpu_s(pid), time.perf_counter()
                await asyncio.sleep(args.pause)
                idle = (cpu_s(pid) - c0) / (time.perf_counter() - t0)
                c0, t0 = cpu_s(pid), time.perf_counter()
                audio = await asyncio.gather(*(one(session, url, budget) for _ in range(args.clients)))
                wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
                rounds.append({
                    "max_tokens": budget, "wall_s": round(wall, 3), "gateway_cpu_s": round(cpu, 3),
                    "idle_cpu_ms_per_s": round(1000 * idle, 3),
                    "requests_cpu_s": round(max(0.0, cpu - idle * wall), 3),
                    "audio_s_per_request": round(float(np.mean(audio)), 3),
                    "loop_lag_max_ms": round(server_gauges(url).get("gateway_loop_lag_max_ms", math.nan), 1),
                })  # fmt: skip
                print(json.dumps(rounds[-1]), flush=True)
    n = args.clients
    # what the requests cost: the round's CPU less the idle gateway's over the round's wall time
    per_request = {
        b: statistics.median(1000 * r["requests_cpu_s"] / n for r in rounds if r["max_tokens"] == b)
        for b in budgets
    }
    idle_ms_per_s = statistics.median(r["idle_cpu_ms_per_s"] for r in rounds)
    audio = {
        b: statistics.median(r["audio_s_per_request"] for r in rounds if r["max_tokens"] == b)
        for b in budgets
    }
    lo, hi = budgets[0], budgets[-1]
    slope = (
        (per_request[hi] - per_request[lo]) / (audio[hi] - audio[lo])
        if audio[hi] > audio[lo]
        else float("nan")
    )
    return {
        "url": url,
        "clients": n,
        "rounds": rounds,
        "cpu_ms_per_request": {str(b): round(v, 3) for b, v in per_request.items()},
        "audio_s_per_request": {str(b): round(v, 3) for b, v in audio.items()},
        # the gateway's CPU per second of audio streamed: its one core, less what the idle gateway
        # takes of it, carries (1000 - idle) / this streams
        "cpu_ms_per_audio_second": round(slope, 3),
        "idle_cpu_ms_per_s": round(idle_ms_per_s, 3),
        "streams_per_gateway_core": round((1000 - idle_ms_per_s) / slope, 1) if slope > 0 else None,
        "loop_lag_max_ms_p50": {
            str(b): statistics.median(r["loop_lag_max_ms"] for r in rounds if r["max_tokens"] == b)
            for b in budgets
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=400, help="requests sent at once in each round")
    ap.add_argument("--max-tokens", default="30,250", help="budgets, prompt included: least audio first")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--pause",
        type=float,
        default=11.0,
        help="seconds before each burst (the lag's 10 s window), over which the idle gateway's CPU is timed "
        "(at least 0.5)",
    )
    ap.add_argument("--label", default="", help="the host measured")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.pause < 0.5:
        ap.error(f"--pause {args.pause:g}: the idle gateway's CPU is timed over it, at least 0.5 s")
    out = {"label": args.label, "commit": commit(), "command": command("voxpipe bench gateway", argv)}
    out |= asyncio.run(run(args))
    print(
        json.dumps(
            {k: out[k] for k in ("cpu_ms_per_request", "cpu_ms_per_audio_second", "streams_per_gateway_core")}
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
