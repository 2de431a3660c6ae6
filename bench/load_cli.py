"""`voxpipe bench load` (and `voxpipe bench --url …`): the load curve of a running server.

The model's limits come from the server (`GET /v1/models`: `max_tokens`, `sample_rate`, the model's
name), so the defaults work against any model: each request asks for up to `--tokens` tokens (1024
by default) but never more than the model's `max_tokens` less `--prompt-allowance`. Each level
says on stderr what it runs and, every few seconds, how far it got. A level whose requests fail
ends early (after `--max-errors` failures), the run stops there, and the exit status is 1: a load
curve over failing requests measures nothing. With `--clone-share 0,0.25` each level runs once per
share, that share of its streams sending a new reference clip per request (`bench.clips`), and
reports its cloned and plain requests apart; a model without preset voices speaks its plain
requests by a voice saved at the start. Metrics and the curve: `bench.load`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from typing import Any

import aiohttp

from bench.clips import Cloning, plain_voice
from bench.load import (
    TEXT_SETS,
    add_client_procs,
    arrivals,
    auth_headers,
    device_label,
    measure_level,
    meets_target,
    plot,
    target_text,
)
from bench.provenance import command, commit

DEFAULT_TOKENS = 1024


def server_model(base: str) -> dict[str, Any]:
    """The served model's card from `GET /v1/models` (empty when the server has none to give)."""
    req = urllib.request.Request(base + "/v1/models", headers=auth_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        data = json.loads(r.read()).get("data") or [{}]
    return data[0]


def fit_tokens(asked: int, allowance: int, max_tokens: int) -> int:
    """The tokens per request: `asked`, within the model's `max_tokens` less the prompt allowance."""
    if max_tokens <= 0:
        return asked
    room = max_tokens - allowance
    if room < 1:
        raise ValueError(
            f"--prompt-allowance {allowance} leaves no tokens within the model's max_tokens {max_tokens}"
        )
    return min(asked, room)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="voxpipe bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--concurrency", default="", help="comma list of concurrent streams, e.g. 1,8,32")
    group.add_argument("--rate", default="", help="comma list of Poisson arrival rates (requests/s)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per level")
    ap.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help="tokens generated per request, at most the model's max_tokens less --prompt-allowance",
    )
    ap.add_argument("--prompt-allowance", type=int, default=100, help="max_tokens = tokens + this")
    ap.add_argument("--sample-rate", type=int, default=0, help="Hz of the audio (default: the model's)")
    ap.add_argument("--model", default="", help="label for the results (default: the served model)")
    ap.add_argument("--device", default="", help="label for the results (default: this machine's GPU)")
    ap.add_argument("--out", default="bench_load.json")
    ap.add_argument("--plot", default="", help="PNG path (needs matplotlib)")
    ap.add_argument("--seed", type=int, default=0)
    starts = ap.add_mutually_exclusive_group()
    starts.add_argument("--ramp", type=float, default=0.0, help="closed loop: spread client starts over S s")
    starts.add_argument(
        "--burst", action="store_true", help="closed loop: every client of a level starts at once (--ramp 0)"
    )
    ap.add_argument(
        "--max-errors", type=int, default=5, help="end the run once a level has this many failures"
    )
    ap.add_argument("--progress", type=float, default=5.0, help="seconds between progress lines (0: none)")
    add_client_procs(ap)
    ap.add_argument(
        "--texts",
        choices=sorted(TEXT_SETS),
        default="mixed",
        help="request texts: mixed (short and long) or sentences (English, 8-15 words)",
    )
    ap.add_argument(
        "--clone-share",
        default="",
        help="comma list of shares of each level's streams (Poisson: requests) that send a new reference "
        "clip per request, e.g. 0,0.25: every level runs once per share (0: the baseline), its cloned and "
        "plain requests reported apart (a model that clones)",
    )
    ap.add_argument("--clip-seconds", type=float, default=3.0, help="seconds of each reference clip")
    return ap.parse_args(argv)


async def _plain_voice(base: str, card: dict[str, Any], seconds: float) -> str:
    """The plain requests' voice: a voice saved here for a model without preset voices, else none."""
    async with aiohttp.ClientSession(headers=auth_headers()) as s:
        return await plain_voice(s, base, card, seconds)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    rates = [float(r) for r in args.rate.split(",") if r]
    if not levels and not rates:
        levels = [1]
    key = "concurrency" if levels else "rate"
    if args.burst:
        args.ramp = 0.0
    how = arrivals(bool(rates), args.ramp)
    try:
        card = server_model(args.url)
        tokens = fit_tokens(args.tokens, args.prompt_allowance, int(card.get("max_tokens", 0)))
    except (OSError, ValueError) as e:
        _say(f"voxpipe bench: cannot read the model's limits from {args.url}/v1/models: {e}")
        return 2
    if tokens < args.tokens:
        _say(f"{card.get('id')}: max_tokens {card.get('max_tokens')}, so {tokens} tokens per request")
    sample_rate = args.sample_rate or int(card.get("sample_rate", 24000))
    voice = asyncio.run(_plain_voice(args.url, card, args.clip_seconds))
    shares = [float(x) for x in args.clone_share.split(",") if x] or [None]
    runs = [(level, share) for level in levels or rates for share in shares]
    curve, failed = [], False
    for i, (level, share) in enumerate(runs):
        cloned = "" if share is None else f", {share:.0%} of its streams cloning"
        _say(f"level {i + 1}/{len(runs)}: {key} {level}{cloned} for {args.duration:.0f} s")
        point = {
            key: level,
            "arrivals": how,
            **measure_level(
                args.url,
                sample_rate,
                duration=args.duration,
                tokens=tokens,
                prompt_allowance=args.prompt_allowance,
                seed=args.seed + i,
                ramp=args.ramp,
                max_errors=args.max_errors,
                progress_s=args.progress,
                client_procs=args.client_procs,
                texts=args.texts,
                cloning=None
                if share is None and not voice
                else Cloning(share or 0.0, voice, args.clip_seconds),
                **({"concurrency": level} if levels else {"rate": level}),
            ),
        }
        curve.append(point)
        print(json.dumps(point), flush=True)
        _say(
            f"  {point['requests']} requests, {point['errors']} failed; TTFA p50 {point['ttfa_p50_ms']} ms; "
            f"x real time per stream p50 {point['x_realtime_per_stream_p50']}, "
            f"slowest {point['x_realtime_per_stream_min']}; on time {100 * point['on_time_share']:.0f} %"
        )
        for kind in ("cloned", "plain") if point.get("clone_share") else ():
            part = point[kind]
            _say(f"  {kind}: {part['requests']} requests, TTFA p50 {part['ttfa_p50_ms']} ms, "
                 f"p99 {part['ttfa_p99_ms']} ms; on time {100 * part['on_time_share']:.0f} %")  # fmt: skip
        if point["errors"]:
            _say(f"requests failed at {key} {level}, stopping: {'; '.join(point['error_examples'])}")
            failed = True
            break
    passing = [p[key] for p in curve if meets_target(p)]
    out = {
        "command": command("voxpipe bench", argv),
        "device": args.device or device_label(),
        "arrivals": how,
        "model": args.model or card.get("id", ""),
        "date": time.strftime("%F"),
        "commit": commit(),
        "tokens_per_request": tokens,
        "duration_s_per_level": args.duration,
        "ramp_s": args.ramp,
        "target": target_text([how]),
        "max_streams_meeting_target": max(passing) if passing else 0,
        "failed": failed,
        "curve": curve,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    first = [
        p for p in curve if (p.get("clone_share") or 0) == (shares[0] or 0)
    ]  # the plot: the first share's curve
    if args.plot and not plot(first, key, args.plot):
        _say("matplotlib is not installed: no plot written (pip install matplotlib)")
    print(json.dumps({k: out[k] for k in ("max_streams_meeting_target", "date")}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
