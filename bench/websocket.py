"""`voxpipe bench ws`: input streaming over the WebSocket (`GET /v1/audio/speech/stream`) of a
running server, as a voice agent uses it: each session appends its text word by word at a set pace
(an LLM writing it), ends its input, and plays the audio as it comes.

    voxpipe bench ws --url http://127.0.0.1:8000 --sessions 1,100 --word-ms 10,30
    voxpipe bench ws --serve qwen3-tts --sessions 1,100 --word-ms 10,33 -- --max-batch-size 256

`--serve MODEL` starts the server itself (dummy weights, as `voxpipe bench ttfa` does), measures it
once it is ready, and stops it.

For each level (N concurrent sessions × a word interval) it reports, over the sessions:
- `first_audio_ms`: from the first append sent to the first audio frame (p50/p90/p99);
- `end_to_done_ms`: from the `end` sent to the last audio frame;
- `no_underrun`: the share of sessions whose every frame after the first came before a player that
  started at the first frame would have run dry (`bench.load.Result.lateness`);
- for the sessions that ran dry, how many, how far behind at worst (`late_worst_ms_p50`/`_p99`),
  when the first late chunk came, and a few in detail (`late_examples`; `bench.load.late_summary`);
- errors (an `error` event, a close other than 1000, a session that never finished), the mode the
  server chose (`native` or `segmented`) and the audio seconds;
- `client_lag_ms` and `client_cpu`: the client's own event-loop lag (how late a 5 ms timer fires,
  p50/p99/max) and its CPU seconds per wall second. A client that lags (tens of ms, or a CPU share
  near 1) times its own queue, not the server's: split the sessions over several clients.
One JSON file (`--out`) holds the levels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.load import SENTENCES, Result, auth_headers, device_label, late_summary, percentile
from bench.load_cli import server_model
from bench.provenance import command, commit, model_settings

PATH = "/v1/audio/speech/stream"
ACK = '{"type":"ack"'  # the server's acks, as it writes them (compact JSON): skipped unparsed


async def one_session(
    http: aiohttp.ClientSession, url: str, opening: dict, words: list[str], word_s: float, timeout: float
) -> tuple[Result, dict[str, Any]]:
    """One session: `words` appended every `word_s` seconds, then `end`; the audio as a Result
    (chunk times from the first append), and {mode, end_to_done_s}."""
    res, info = Result(), {"mode": "", "end_to_done_s": float("nan")}
    got, ended = 0, float("nan")
    try:
        async with http.ws_connect(
            url, headers=auth_headers(), timeout=aiohttp.ClientWSTimeout(ws_receive=timeout)
        ) as ws:
            await ws.send_json({"type": "session", **opening})
            started = json.loads((await ws.receive(timeout=timeout)).data)
            if started.get("type") != "session.started":
                res.error = f"no session: {started}"
                return res, info
            info["mode"] = started.get("mode", "")
            appends = [json.dumps({"type": "append", "text": word}) for word in words]
            t0 = time.perf_counter()

            async def feed() -> None:
                # Word k goes at t0 + k * word_s (a late wake-up does not delay the words after it).
                nonlocal ended
                for k, message in enumerate(appends):
                    await ws.send_str(message)
                    await asyncio.sleep(max(0.0, t0 + (k + 1) * word_s - time.perf_counter()))
                await ws.send_str('{"type": "end"}')
                ended = time.perf_counter() - t0

            feeder = asyncio.create_task(feed())
            try:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        got += len(msg.data)
                        now = time.perf_counter() - t0
                        if not res.chunks:
                            res.ttfa = now
                        res.chunks.append((now, got))
                    elif msg.type == aiohttp.WSMsgType.TEXT and not msg.data.startswith(ACK):
                        event = json.loads(msg.data)
                        if event["type"] == "error":
                            res.error = event["message"][:200]
                        elif event["type"] == "done":
                            res.ok = not res.error
            finally:
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            if ws.close_code != 1000 and not res.error:
                res.error = f"closed with {ws.close_code}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    if res.ok and res.chunks and ended == ended:
        info["end_to_done_s"] = res.chunks[-1][0] - ended
    return res, info


class LoopLag:
    """The running event loop's lag while `run` runs: how much later than asked a PERIOD_S sleep
    wakes (a loop busy with other callbacks delays every message it sends and reads as much)."""

    PERIOD_S = 0.005

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.PERIOD_S)
            self.lags.append(time.perf_counter() - t - self.PERIOD_S)

    def summary(self) -> dict[str, Any]:
        """{client_lag_ms: {p50, p99, max}, client_cpu: CPU s per wall s} since construction."""
        ms = [1000 * x for x in self.lags] or [0.0]
        cpu = (time.process_time() - self.cpu0) / max(1e-9, time.perf_counter() - self.wall0)
        lag = {
            "p50": round(percentile(ms, 50), 1),
            "p99": round(percentile(ms, 99), 1),
            "max": round(max(ms), 1),
        }
        return {"client_lag_ms": lag, "client_cpu": round(cpu, 3)}


def words_of(index: int, n_sentences: int) -> list[str]:
    """Session `index`'s text as word-by-word appends (each word with the space before it)."""
    text = " ".join(SENTENCES[(index + k) % len(SENTENCES)] for k in range(n_sentences))
    first, *rest = text.split(" ")
    return [first, *(" " + w for w in rest)]


async def run_level(base: str, sessions: int, word_ms: float, args: argparse.Namespace, model: dict) -> dict:
    opening = {"model": model.get("id", ""), "seed": args.seed}
    for name in ("max_tokens", "min_tokens"):
        if getattr(args, name):
            opening[name] = getattr(args, name)
    connector = aiohttp.TCPConnector(limit=0)
    lag = LoopLag()
    watch = asyncio.create_task(lag.run())
    async with aiohttp.ClientSession(connector=connector) as http:
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(
                one_session(
                    http,
                    base + PATH,
                    {**opening, "seed": args.seed + i},
                    words_of(i, args.sentences),
                    word_ms / 1000,
                    args.timeout,
                )
                for i in range(sessions)
            )
        )
        wall = time.perf_counter() - t0
    watch.cancel()
    rate = int(model.get("sample_rate") or 24000)
    ok = [(r, info) for r, info in runs if r.ok and r.chunks]
    first = [1000 * r.ttfa for r, _ in ok]
    tail = [1000 * info["end_to_done_s"] for _, info in ok]
    return {
        "sessions": sessions,
        "word_ms": word_ms,
        "mode": sorted({info["mode"] for _, info in runs if info["mode"]}),
        "ok": len(ok),
        "errors": [r.error for r, _ in runs if not r.ok][:10],
        "n_errors": sum(not r.ok for r, _ in runs),
        "first_audio_ms": _quantiles(first),
        "end_to_done_ms": _quantiles(tail),
        "no_underrun": round(sum(r.on_time(rate) for r, _ in ok) / max(1, len(ok)), 4),
        **late_summary([r for r, _ in ok], rate),
        "audio_s": round(sum(r.audio_s(rate) for r, _ in ok), 2),
        "wall_s": round(wall, 2),
        **lag.summary(),
    }


def _quantiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 1) for q in (50, 90, 99)}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="voxpipe bench ws", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (http:// or https://)")
    ap.add_argument("--sessions", default="1", help="concurrent sessions per level, comma-separated")
    ap.add_argument("--word-ms", default="10", help="ms between appended words, comma-separated levels")
    ap.add_argument("--sentences", type=int, default=2, help="sentences of text per session")
    ap.add_argument("--seed", type=int, default=0, help="session i speaks with seed + i")
    ap.add_argument("--max-tokens", type=int, default=0, help="the sessions' max_tokens (0: the model's)")
    ap.add_argument("--min-tokens", type=int, default=0, help="the sessions' min_tokens (0: none)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a session may stay silent")
    ap.add_argument("--out", default="", help="write the JSON result here")
    ap.add_argument(
        "--serve",
        default="",
        metavar="MODEL",
        help="start `voxpipe serve --model MODEL --load-format dummy` on --port (with the flags after --), "
        "measure it once ready and stop it (instead of --url)",
    )
    ap.add_argument("--port", type=int, default=8124, help="the port of --serve's server")
    ap.add_argument("serve_args", nargs="*", help="extra `voxpipe serve` flags for --serve (after --)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.command = command("voxpipe bench ws", argv)
    if not args.serve:
        return measure(args, args.url.rstrip("/"))
    from bench.ttfa_http import served

    with served(args.serve, args.port, args.serve_args) as (base, _):
        return measure(args, base)


def measure(args: argparse.Namespace, base: str) -> int:
    """Every level (sessions × word interval) against the server at `base`; 1 when any session failed."""
    model = server_model(base)
    levels = []
    for sessions in (int(x) for x in args.sessions.split(",")):
        for word_ms in (float(x) for x in args.word_ms.split(",")):
            level = asyncio.run(run_level(base, sessions, word_ms, args, model))
            print(json.dumps(level), flush=True)
            levels.append(level)
    result = {"bench": "ws", "url": base, "model": model.get("id", ""), "device": device_label()}
    result |= {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit()}
    result |= {"command": getattr(args, "command", ""), "levels": levels}
    if args.serve:
        result["model_settings"] = model_settings(args.serve, args.serve_args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(level["n_errors"] for level in levels) else 0


if __name__ == "__main__":
    raise SystemExit(main())
