"""Single-stream time to first audio at the HTTP client, through every process of `voxpipe serve`,
and optionally the load curve on the same server.

Starts the server (dummy weights unless told otherwise), sends sequential streaming requests and
times the first PCM byte after the WAV header. Writes JSON with the samples and their p50. With
`--load 64,128,…` it then runs `voxpipe bench` levels (closed loop) against the same server and
writes the curve (`--load-out`, `--plot`), with the server's own gauges (measured stream capacity,
row period) read from /metrics after each level.

For a model that clones voices, `--clone-reps N` also times N requests with a new reference clip
each (`clip_ttfa_ms`: the clip decoded and encoded every time) and N by a voice saved once
(`voice_ttfa_ms`), and `--clone-share 0,0.25` runs each load level once per share of its streams
sending a new clip per request, the cloned and plain requests reported apart (bench.clips). A model
without preset voices speaks the plain requests by a voice saved first. `served` starts and stops
the server (`voxpipe bench ws --serve` uses it too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import aiohttp

from bench.provenance import command, commit, model_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `--tap-level` at a burst: seconds the tap is given to start and subscribe before the burst's
# requests go (its process starts in about a second), so that it sees the burst from its start.
TAP_CONNECT_S = 2.0


async def one(
    session: aiohttp.ClientSession, url: str, body: dict | aiohttp.FormData
) -> tuple[float, float, int]:
    """One streamed /generate request (JSON, or a form with a clip): (first audio s, whole s, bytes)."""
    t0 = time.perf_counter()
    first = None
    n = 0
    async with session.post(url, **({"json": body} if isinstance(body, dict) else {"data": body})) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for data in r.content.iter_any():
            n += len(data)
            if first is None and n > 44:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), time.perf_counter() - t0, n - 44


def request_body(tokens: int, seed: int, allowance: int) -> dict:
    """A single-stream request of `tokens` generated rows; its max_tokens counts the prompt, which
    `allowance` covers."""
    return {
        "text": "Hello, how are you today?",
        "seed": seed,
        "max_tokens": allowance + tokens,
        "min_tokens": tokens,
    }


async def measure(
    base: str, reps: int, tokens: int, clone_reps: int, clip_s: float, allowance: int
) -> tuple[dict, str]:
    """Sequential requests, after a warm-up: `reps` plain ones ("plain"; by a saved voice where the
    model has no preset voices), and with `clone_reps` > 0 as many with a new clip each ("clip") and
    by a voice saved once ("voice"). Each: a list of (first audio s, whole s, bytes); and the plain
    requests' voice ("": the model's default)."""
    from bench.clips import Cloning, clip_wav, plain_voice, save_voice
    from bench.load import auth_headers
    from bench.load_cli import server_model

    url = base + "/generate"
    async with aiohttp.ClientSession(headers=auth_headers()) as s:
        plain = Cloning(voice=await plain_voice(s, base, server_model(base), clip_s), seconds=clip_s)
        await one(s, url, plain.request(request_body(tokens, 1, allowance), False))  # warm-up
        out = {
            "plain": [
                await one(s, url, plain.request(request_body(tokens, i, allowance), False))
                for i in range(reps)
            ]
        }
        if clone_reps:
            await one(
                s, url, plain.request(request_body(tokens, 1, allowance), True)
            )  # warm-up of the encoders
            out["clip"] = [
                await one(s, url, plain.request(request_body(tokens, i, allowance), True))
                for i in range(clone_reps)
            ]
            await save_voice(s, base, "bench-saved", clip_wav(1, clip_s))
            saved = Cloning(voice="bench-saved")
            out["voice"] = [
                await one(s, url, saved.request(request_body(tokens, i, allowance), False))
                for i in range(clone_reps)
            ]
        return out, plain.voice


def quantiles(ms: list[float]) -> dict[str, float]:
    from bench.load import percentile

    return {f"p{q}": round(percentile(ms, q), 2) for q in (50, 90, 99)}


def load_curve(base: str, args) -> None:
    from bench.clips import Cloning
    from bench.load import (
        arrivals,
        device_label,
        measure_level,
        meets_target,
        plot,
        server_gauges,
        target_text,
    )
    from bench.tap_stats import read, stats

    curve = []
    levels = [("concurrency", int(c)) for c in args.load.split(",") if c]
    levels += [("rate", float(r)) for r in args.rate.split(",") if r]
    shares = [float(x) for x in args.clone_share.split(",") if x]
    closed = arrivals(False, args.ramp)  # the concurrency levels': ramp or burst
    device = args.label or device_label()
    runs = [(key, level, share) for key, level in levels for share in shares or [None]]
    for i, (key, level, share) in enumerate(runs):
        # no --clone-share: plain requests alone (by the saved voice of a model without preset ones)
        cloning = (
            Cloning(share or 0.0, args.plain_voice, args.clip_seconds)
            if share is not None or args.plain_voice
            else None
        )
        point = {key: level, "arrivals": arrivals(key == "rate", args.ramp)}
        watching: list[threading.Thread] = []  # the tap first, where this level has one

        def observe(level=level, point=point, watching=watching) -> None:
            """The level's tap and profiles, started as it is about to start (its clients ready)."""
            if level == args.tap_level and (point["arrivals"] == "burst" or args.tap_from_start):
                # A burst's start is what to see (or, asked, any level's: the load coming to a
                # server idle after the single streams): the tap connects before its requests go.
                watching.append(start_tap(args, delay_s=0.0, seconds=args.tap_seconds + TAP_CONNECT_S))
                time.sleep(TAP_CONNECT_S)
            elif level == args.tap_level:
                watching.append(start_tap(args, delay_s=args.ramp + 2))
            if level == args.profile_level:
                watching.extend(start_py_spy(args, delay_s=args.ramp + 2))

        client_ttfa: dict[str, float] = {}
        client_began: dict[str, float] = {}
        point |= measure_level(base, 24000, client_ttfa, **{key: level}, duration=args.load_duration,
                               tokens=args.load_tokens, prompt_allowance=args.prompt_allowance, seed=i, ramp=args.ramp,
                               texts=args.texts, cloning=cloning, client_procs=args.client_procs,
                               before=observe, began_by_rid=client_began)  # fmt: skip
        point["server_after"] = server_gauges(base)
        for thread in watching:
            thread.join()
        if level == args.tap_level:
            wave = level if point["arrivals"] == "burst" else 0  # the timeline of the burst itself
            point["tap"] = stats(read(args.tap_out), client_ttfa, client_began, wave=wave)
        curve.append(point)
        print(json.dumps(point), flush=True)
        out = {
            "command": command("voxpipe bench ttfa", args.argv),
            "device": device,
            "arrivals": closed if any(k == "concurrency" for k, _ in levels) else "poisson",
            "model": f"{args.model} dummy",
            "date": time.strftime("%F"),
            "commit": commit(),
            "serve_args": args.serve_args,
            "model_settings": model_settings(args.model, args.serve_args),
            "tokens_per_request": args.load_tokens,
            "duration_s_per_level": args.load_duration,
            "ramp_s": args.ramp,
            "target": target_text(p["arrivals"] for p in curve),
            "max_streams_meeting_target": max(
                [p["concurrency"] for p in curve if "concurrency" in p and meets_target(p)], default=0
            ),
            "max_rate_meeting_target": max(
                [p["rate"] for p in curve if "rate" in p and meets_target(p)], default=0
            ),
            "curve": curve,
        }
        with open(args.load_out, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot and curve:  # the curve of the first clone share
        plot([p for p in curve if p.get("clone_share", 0) == (shares or [0])[0]], levels[0][0], args.plot)


def start_tap(args, delay_s: float, seconds: float | None = None) -> threading.Thread:
    """`voxpipe tap --all-chunks` on this server for `seconds` (`--tap-seconds`), from `delay_s` into
    the level (past the ramp; a burst's from before it), into `--tap-out` (gzipped where its name
    ends in .gz)."""
    from bench.tap_stats import write

    def go() -> None:
        cmd = [sys.executable, "-m", "common.cli", "tap", "--port", str(args.port), "--all-chunks",
               "--seconds", str(args.tap_seconds if seconds is None else seconds)]  # fmt: skip
        write(args.tap_out, subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False).stdout)

    return later(delay_s, go)


def start_py_spy(args, delay_s: float) -> list[threading.Thread]:
    """`py-spy record` (collapsed stacks, idle included) of each worker process named in
    `--profile-roles`, for `--tap-seconds` from `delay_s` into the level: `<profile-out>-<role>.txt`."""

    def go(role: str) -> None:
        pids = subprocess.run(
            ["pgrep", "-f", "--", f"-m {role} "], capture_output=True, text=True
        ).stdout.split()
        for pid in pids[:1]:
            cmd = ["py-spy", "record", "-p", pid, "--duration", str(int(args.tap_seconds)), "--rate", "250",
                   "--idle", "--format", "raw", "-o", f"{args.profile_out}-{role}.txt"]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            print(f"py-spy {role} (pid {pid}): rc {res.returncode} {res.stderr[-300:]}", flush=True)

    return [later(delay_s, go, role) for role in args.profile_roles.split(",")]


def later(delay_s: float, fn, *args) -> threading.Thread:
    """`fn(*args)` after `delay_s`, in a daemon thread (started; join it for the result)."""

    def run() -> None:
        time.sleep(delay_s)
        fn(*args)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    from bench.load import add_client_procs

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="orpheus")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--out", default="ttfa_http.json")
    ap.add_argument("--load", default="", help="comma list of concurrency levels to run afterwards")
    ap.add_argument("--rate", default="", help="comma list of Poisson arrival rates (requests/s) after those")
    ap.add_argument("--texts", default="mixed", help="request texts of the load: mixed or sentences")
    ap.add_argument("--load-duration", type=float, default=30.0)
    ap.add_argument(
        "--prompt-allowance",
        type=int,
        default=100,
        help="max_tokens = --tokens (single streams) or --load-tokens (the load) + this",
    )
    ap.add_argument("--load-tokens", type=int, default=1024)
    starts = ap.add_mutually_exclusive_group()
    starts.add_argument("--ramp", type=float, default=0.0, help="closed loop: spread client starts over S s")
    starts.add_argument("--burst", action="store_true", help="closed loop: every client of a level at once")
    add_client_procs(ap)
    ap.add_argument("--load-out", default="load.json")
    ap.add_argument("--plot", default="")
    ap.add_argument("--label", default="", help="device label for the load results")
    ap.add_argument("--tap-level", type=int, default=0, help="record `voxpipe tap` during this load level")
    ap.add_argument("--tap-seconds", type=float, default=8.0)
    ap.add_argument(
        "--tap-from-start",
        action="store_true",
        help="the tap records the tapped level from its first request (a burst's always; others: from 2 s "
        "past the ramp)",
    )
    ap.add_argument(
        "--tap-out",
        default="tap.jsonl.gz",
        help="the tapped level's events: JSON lines, gzipped where the name ends in .gz",
    )
    ap.add_argument("--profile-level", type=int, default=0, help="py-spy the workers during this load level")
    ap.add_argument("--profile-roles", default="gpu_worker,codec_worker")
    ap.add_argument("--profile-out", default="py-spy")
    ap.add_argument(
        "--clone-reps",
        type=int,
        default=0,
        help="also time N requests with a new reference clip each (clip_ttfa_ms) and N by a saved voice "
        "(voice_ttfa_ms); for a model that clones",
    )
    ap.add_argument("--clip-seconds", type=float, default=3.0, help="seconds of each reference clip")
    ap.add_argument(
        "--clone-share", default="",
        help="comma list of shares of each load level's streams that send a new clip per request, e.g. 0,0.25: "
        "every level runs once per share (0: the baseline); each level reports its cloned and plain requests apart",
    )  # fmt: skip
    ap.add_argument("serve_args", nargs="*", help="extra `voxpipe serve` flags (after --)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.burst:
        args.ramp = 0.0
    with served(args.model, args.port, args.serve_args) as (base, startup):
        res, args.plain_voice = asyncio.run(
            measure(base, args.reps, args.tokens, args.clone_reps, args.clip_seconds, args.prompt_allowance)
        )
        out = {
            "model": f"{args.model} dummy",
            "date": time.strftime("%F"),
            "commit": commit(),
            "serve_args": args.serve_args,
            "model_settings": model_settings(args.model, args.serve_args),
            "startup_s": round(startup, 1),
            "ttfa_p50_ms": ttfa_of(res["plain"])["p50"],
            "ttfa_p99_ms": ttfa_of(res["plain"])["p99"],
            "ttfa_ms": ttfa_of(res["plain"])["samples"],
            "request_s": [round(r[1], 3) for r in res["plain"]],
            "audio_s": [round(r[2] / 2 / 24000, 3) for r in res["plain"]],
        }
        if args.clone_reps:
            out |= {"clip_seconds": args.clip_seconds, "clip_ttfa_ms": ttfa_of(res["clip"])}
            out |= {"voice_ttfa_ms": ttfa_of(res["voice"])}
        with open(args.out, "w") as f:  # before the load curve, which may run out of time
            json.dump(out, f, indent=1)
        print(json.dumps(out), flush=True)
        if args.load or args.rate:
            load_curve(base, args)
    return 0


def ttfa_of(res: list[tuple[float, float, int]]) -> dict:
    """The first-audio times of `res` in ms: p50, p90, p99 and the samples."""
    ms = [r[0] * 1000 for r in res]
    return {**quantiles(ms), "samples": [round(t, 2) for t in ms]}


@contextlib.contextmanager
def served(model: str, port: int, serve_args: list[str]) -> Iterator[tuple[str, float]]:
    """`voxpipe serve --model MODEL` on dummy weights (constrained where the model can be) with
    `serve_args`, ready: yields (its base URL, seconds to ready) and stops it on the way out. A
    SIGTERM meanwhile (gpu.sh's stage timeout) exits through here too, so the server never outlives
    its bench. RuntimeError when it stops or is not ready within 400 s."""
    from programs import get_spec

    cmd = [sys.executable, "-m", "common.cli", "serve", "--model", model, "--port", str(port)]
    constrained = ["--constrained"] if get_spec(model).get("constrainable") else []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server = subprocess.Popen([*cmd, "--load-format", "dummy", *constrained, *serve_args], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, wait_ready(server, base)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        signal.signal(signal.SIGTERM, previous)


def wait_ready(server: subprocess.Popen, base: str, limit_s: float = 400) -> float:
    """Seconds until `base`/ready answers 200; RuntimeError when `server` stops or `limit_s` passes."""
    t0 = time.monotonic()
    while server.poll() is None and time.monotonic() - t0 < limit_s:
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


if __name__ == "__main__":
    sys.exit(main())
