"""Load benchmark over the HTTP API: fixed concurrency (its clients started over a ramp, or all at
once: a burst) or Poisson arrivals, bounded in time.

Each request streams `POST /generate` with `min_tokens` = `max_tokens` - prompt allowance, so random
weights produce a fixed amount of audio. Per request it records the time to first audio (first PCM
byte after the WAV header) and every chunk's arrival. A chunk is *on time* when the audio received
before it covers the playback time elapsed since the first chunk (a player that started at the
first byte would not have run dry); a request is on time when all its chunks are. A request the
server refuses at admission (503 with Retry-After: past capacity, the bounded wait over) is
*rejected*, not failed: its client waits the Retry-After (within the level) and sends the next.

For each load level it reports TTFA p50/p90/p99, the share of requests fully on time (and how late
the late ones were), aggregate × real time (audio seconds delivered per wall second) and errors,
and the server's own gauges sampled during the level (`server_during`: batch size, measured
capacity, step host/wait time, codec windows per call and busy seconds per second; `bound`: what
sets the pace, `step_bounds`); it writes JSON (and a PNG when matplotlib is installed). `max_streams_meeting_target` is the largest
level that meets the target of its arrivals (`TARGETS`: no errors or refusals, and under a ramp
≥ 99 % of requests on time with TTFA p99 ≤ 250 ms, under a burst every request on time with TTFA
p99 ≤ 500 ms, under Poisson arrivals every request on time with TTFA p95 ≤ 60 ms; the largest such
rate is `max_rate_meeting_target`). A server that requires a key gets VOXPIPE_API_KEY's.
The command line (model limits from the server, progress, stopping on failures): `bench.load_cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from bench.clips import Cloning, split
from common.loop_lag import LoopLag
from common.proc import use_uvloop

HEADER = 44


def auth_headers() -> dict[str, str]:
    """The Bearer key a server started with VOXPIPE_API_KEY requires (none when unset)."""
    key = os.environ.get("VOXPIPE_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should start quickly and never stall.",
    "Many listeners at once, each hearing audio without gaps.",
    "A short sentence.",
]
# English sentences of 8 to 15 words, the request texts of the published Qwen3-TTS serving figures
# (`--texts sentences`).
SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river.",
    "Please remember to bring your ticket and your passport to the station.",
    "The weather will be warm and sunny this afternoon, with rain tonight.",
    "Could you tell me where the old library is in this town?",
    "Every morning I make coffee and listen to the radio before work.",
    "Thank you so much for coming today, we have a lot to discuss.",
    "Streaming speech should start quickly and never stall, even under heavy load.",
    "She said it would be a long night, but nobody wanted to leave.",
]
TEXT_SETS = {"mixed": TEXTS, "sentences": SENTENCES}


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttfa: float = float("nan")  # seconds
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time since send, bytes so far)
    sent_at: float = float("nan")  # seconds into its load level when it was sent
    rid: str = ""  # the X-Request-Id it was sent with (joins it to a `voxpipe tap` recording)
    retry_after_s: float = 0.0  # > 0: refused at admission (503 with Retry-After), come back then
    cloned: bool = False  # sent with a new reference clip (bench.clips)
    # seconds its new connection took to open (0.0: the request reused one); ~1 s or more where the
    # server's accept queue was full and the SYN went again (`voxpipe bench connect`)
    connect_s: float = 0.0
    # seconds from its start to its request's headers written: the client's own wait (its event loop
    # busy with the other streams of a burst, the connection) before the server can see it
    send_s: float = float("nan")
    # the wall clock (time.time()) at its start: joins it to a tap recording's times on one host
    began: float = float("nan")

    def on_time(self, sample_rate: int, slack_s: float = 0.0) -> bool:
        """Every chunk came before the audio received ahead of it had played out (give or take
        `slack_s` >= 0)."""
        return self.ok and bool(self.chunks) and self.lateness(sample_rate)[0] <= slack_s

    def lateness(self, sample_rate: int) -> tuple[float, float]:
        """(the furthest any chunk came behind playback, seconds after the first chunk the first
        late one came); (0.0, nan) when every chunk was on time. Tells a stream that starved at
        its start from one that fell behind later."""
        worst, first_late = 0.0, float("nan")
        for _, since, late in self._behind(sample_rate):
            if late > 0:
                worst = max(worst, late)
                if first_late != first_late:  # nan: the first late chunk
                    first_late = since
        return worst, first_late

    def _behind(self, sample_rate: int):
        """(index, seconds since the first chunk, seconds behind playback) of every chunk after
        the first: behind is the time since the first chunk less the audio received before it."""
        t0 = self.chunks[0][0] if self.chunks else 0.0
        for i in range(1, len(self.chunks)):
            since = self.chunks[i][0] - t0
            yield i, since, since - self.chunks[i - 1][1] / 2 / sample_rate

    def audio_s(self, sample_rate: int) -> float:
        return (self.chunks[-1][1] / 2 / sample_rate) if self.chunks else 0.0

    def x_realtime(self, sample_rate: int) -> float:
        """This stream's own pace: its audio seconds over the seconds from sending to its last chunk."""
        return (
            self.audio_s(sample_rate) / self.chunks[-1][0] if self.chunks and self.chunks[-1][0] > 0 else 0.0
        )

    def late_detail(self, sample_rate: int) -> dict:
        """A late request, for a person to read: when it was sent, its first audio and how much
        audio that first chunk held, and which chunk came late first, how far into the stream and
        how far behind playback; `rid` joins it to a `voxpipe tap` recording."""
        worst, first_late = self.lateness(sample_rate)
        first_bytes = self.chunks[0][1]
        index = next((i for i, _, late in self._behind(sample_rate) if late > 0), None)
        return {
            "rid": self.rid,
            "sent_at_s": round(self.sent_at, 2),
            "ttfa_ms": round(1000 * self.ttfa, 1),
            "first_chunk_audio_ms": round(1000 * first_bytes / 2 / sample_rate, 1),
            "first_late_chunk": index,
            "first_late_at_s": round(first_late, 3),
            "worst_late_ms": round(1000 * worst, 1),
            "chunks": len(self.chunks),
        }


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict | aiohttp.FormData, since: float = 0.0, rid: str = ""
) -> Result:
    """One streamed request (a JSON body, or a form: a cloned one); `since`: when its load level
    began (perf_counter), for `sent_at`; `rid`: sent as X-Request-Id when given."""
    res = Result(rid=rid, cloned=isinstance(body, aiohttp.FormData))
    t0 = time.perf_counter()
    res.sent_at, res.began = t0 - since, time.time()
    got = 0
    headers = {"X-Request-Id": rid} if rid else None
    timing: dict[str, float] = {}  # filled by `connect_timing` where the session traces with it
    try:
        sent = {"json": body} if isinstance(body, dict) else {"data": body}
        async with session.post(url, **sent, headers=headers, trace_request_ctx=timing) as r:
            res.connect_s = timing.get("connect_s", 0.0)
            res.send_s = timing.get("sent_at", float("nan")) - t0
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                if r.status == 503 and r.headers.get("Retry-After", "").isdigit():
                    res.retry_after_s = max(1.0, float(r.headers["Retry-After"]))
                return res
            async for data in r.content.iter_any():
                got += len(data)
                if got > HEADER:
                    now = time.perf_counter() - t0
                    if not res.chunks:
                        res.ttfa = now
                    res.chunks.append((now, got - HEADER))
        res.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def connect_timing() -> aiohttp.TraceConfig:
    """A session's trace that puts into each request's `trace_request_ctx` (a dict) its new
    connection's opening time ("connect_s") and when its headers were written ("sent_at",
    perf_counter)."""

    async def start(_session, ctx, _params) -> None:
        ctx.connect_t0 = time.perf_counter()

    async def end(_session, ctx, _params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["connect_s"] = time.perf_counter() - ctx.connect_t0

    async def sent(_session, ctx, _params) -> None:
        if isinstance(ctx.trace_request_ctx, dict):
            ctx.trace_request_ctx["sent_at"] = time.perf_counter()

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_start.append(start)
    trace.on_connection_create_end.append(end)
    trace.on_request_headers_sent.append(sent)
    return trace


# A level split over client processes starts this long after they are told (each already waits).
PART_START_S = 0.05
RETRIED_CONNECT_S = 0.9  # a new connection this slow waited for a SYN retry (Linux's first: 1 s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


# Per-worker averages: the mean over workers (the rest, counts and counters, add up).
_AVERAGED = (
    "row_period_ms", "step_host_ms", "step_wait_ms", "step_gpu_forward_ms", "step_gpu_ms", "step_gpu_idle_ms",
    "step_launch_ms", "step_launch_prompt_ms", "late_margin_ms", "step_hold_ms", "life_context", "step_cost_fixed_ms", "step_cost_token_us",
    "step_cost_kcontext_us", "step_cost_prompt_ms", "step_cost_group_ms",
)  # fmt: skip


def metric_sums(base: str, wanted: Callable[[str], bool]) -> tuple[dict[str, float], dict[str, int]]:
    """The gateway's /metrics (with the Bearer key of VOXPIPE_API_KEY when set): each series whose
    name less "voxpipe_" (up to its labels or its value) is `wanted`, summed over its label sets, and
    how many label sets each had."""
    out: dict[str, float] = {}
    seen: dict[str, int] = {}
    req = urllib.request.Request(base + "/metrics", headers=auth_headers())
    with urllib.request.urlopen(req, timeout=5) as r:
        for line in r.read().decode().splitlines():
            k = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("voxpipe_")
            if wanted(k):
                out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
                seen[k] = seen.get(k, 0) + 1
    return out, seen


def server_gauges(base: str) -> dict[str, float]:
    """Worker gauges and counters worth keeping next to a load level, from the gateway's /metrics
    (`metric_sums`): summed over workers, but the per-step averages averaged."""
    keep = (
        *_AVERAGED, "stream_capacity", "decode_batch_size", "kv_pages_used", "active_streams", "queue_depth",
        "codec_calls_total", "codec_windows_total", "codec_busy_seconds_total", "admission_queue_length",
        "streams_sitting_out", "prompts_started_total", "steps_total", "steps_borrowing_total",
        "steps_withholding_total", "gateway_loop_lag_max_seconds",
    )  # fmt: skip
    # every admission_stopped_by_* counter too
    out, seen = metric_sums(
        base, lambda k: k in keep or (k.startswith("admission_stopped_by_") and k.endswith("_total"))
    )
    for k in _AVERAGED:
        if k in out:
            out[k] /= seen[k]
    if "gateway_loop_lag_max_seconds" in out:  # in ms: the results round gauges to 0.01
        out["gateway_loop_lag_max_ms"] = 1000 * out.pop("gateway_loop_lag_max_seconds")
    return out


def streams_behind(base: str) -> float | None:
    """The gateway's count of streamed requests whose audio fell behind playback on its side
    (`voxpipe_stream_behind_seconds_count`), None where it cannot be read."""
    name = "stream_behind_seconds_count"
    try:
        return metric_sums(base, lambda k: k == name)[0].get(name)
    except (OSError, ValueError):
        return None


# The gauges a level's `timeline` follows (bench results: admission waits against capacity dips).
TIMELINE_GAUGES = (
    "active_streams", "stream_capacity", "admission_queue_length", "row_period_ms", "streams_sitting_out",
    "life_context", "step_cost_fixed_ms", "step_cost_token_us", "step_cost_kcontext_us", "step_cost_prompt_ms",
    "step_cost_group_ms", "gateway_loop_lag_max_ms",
)  # fmt: skip
# ... and the counters whose rate it follows, sample to sample (a burst's admission, step by step).
TIMELINE_RATES = (
    "prompts_started_total",
    "steps_total",
    "admission_stopped_by_room_total",
    "steps_borrowing_total",
    "steps_withholding_total",
)
# How often a level's gauges are read: a burst's admission is over in a second or two.
SAMPLE_S, BURST_SAMPLE_S = 1.0, 0.25


class GaugeSampler:
    """Reads the server's gauges every `every` seconds while a load level runs (the gauges after a
    level show a draining server); `summary()` gives each gauge's median over the busy samples, and
    each counter's rate over the level (summed over workers), with the codec's windows per call."""

    def __init__(self, base: str, every: float = 1.0) -> None:
        self.base, self.every, self.samples = base, every, []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.samples.append((time.monotonic(), server_gauges(self.base)))
            except Exception as e:  # a 401, a server restarting, a torn read: say so in the summary
                self.failures.append(f"{type(e).__name__}: {e}"[:200])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        self.stop()
        busy = [s for _, s in self.samples if s.get("decode_batch_size", 0) > 0]
        keys = sorted({k for s in busy for k in s if not k.endswith("_total")})
        out: dict = {k: round(statistics.median(s[k] for s in busy if k in s), 3) for k in keys}
        if busy:
            out["max_decode_batch_size"] = max(s.get("decode_batch_size", 0) for s in busy)
            # Admission holds requests at the gateway while the measured capacity is below the
            # streams active: how low it went, and how many waited.
            out["min_stream_capacity"] = min(s.get("stream_capacity", 0) for s in busy)
            out["max_admission_queue_length"] = max(s.get("admission_queue_length", 0) for s in busy)
            # How often and how low: a median capacity above the load still queues requests when it
            # dips below it now and then.
            out["stream_capacity_p10"] = percentile([s.get("stream_capacity", 0) for s in busy], 10)
            out["admission_queued_share"] = round(
                sum(s.get("admission_queue_length", 0) > 0 for s in busy) / len(busy), 3
            )
        out["samples"] = len(busy)
        if self.samples:  # what admission saw, second by second (from the first sample; None: no gauge)
            t0 = self.samples[0][0]
            out["timeline"] = {"t_s": [round(t - t0, 2) for t, _ in self.samples]} | {
                key: [None if s.get(key) is None else round(s[key], 2) for _, s in self.samples]
                for key in TIMELINE_GAUGES
            }
            for key in TIMELINE_RATES:  # over each interval since the sample before (None: no reading)
                pairs = zip(self.samples, self.samples[1:], strict=False)
                out["timeline"][key.removesuffix("_total") + "_per_s"] = [None] + [
                    round((b[key] - a[key]) / (tb - ta), 1)
                    if key in a and key in b and b[key] >= a[key]
                    else None
                    for (ta, a), (tb, b) in pairs
                ]
        bound = step_bounds(out)
        if bound:
            out["bound"] = bound
        if self.failures:
            out["sample_failures"] = len(self.failures)
            out["sample_failure_example"] = self.failures[0]
        if len(self.samples) >= 2:
            (t0, first), (t1, last) = self.samples[0], self.samples[-1]
            # A worker missing from a sample, or restarted (its counters from 0), gives no rate.
            delta = {k: last[k] - first[k] for k in last if k.endswith("_total") and k in first}
            delta = {k: d for k, d in delta.items() if d >= 0}
            for k, d in delta.items():
                out[k.removesuffix("_total") + "_per_s"] = round(d / (t1 - t0), 3)
            if delta.get("steps_total") and "prompts_started_total" in delta:
                out["prompts_per_step"] = round(delta["prompts_started_total"] / delta["steps_total"], 2)
            if delta.get("codec_calls_total") and "codec_windows_total" in delta:
                out["codec_windows_per_call"] = round(
                    delta["codec_windows_total"] / delta["codec_calls_total"], 1
                )
        return out


# `step_bounds`: a share of the step interval past which that part sets the pace
BOUND_SHARE = 0.9


def step_bounds(gauges: dict) -> dict:
    """What sets a level's pace, from its gauges' medians (`server_during`): the share of the step
    interval the device spends on a step (`gpu_busy_share`), the host's own work per step
    (`host_share`: overlapped with the device, it bounds only near 1, the device then idle between
    steps; without a device time, a CPU's, the host runs the steps) and the codec's busy seconds per
    second; the fitted step cost split at the level's batch
    and life-average context into its fixed part (weights read, kernel launches), its part per row
    (the GEMMs) and its part per token of context (attention), in ms; and the verdict: "codec",
    "host", "gpu: <its largest part>" (each at BOUND_SHARE or more), or "none" (the steps wait for
    work). {} without the gauges."""
    interval, gpu = gauges.get("row_period_ms"), gauges.get("step_gpu_ms")
    if not interval or gpu is None:
        return {}
    out = {  # no device time (a CPU, eager steps): the host runs the steps itself
        "gpu_busy_share": round(min(1.0, gpu / interval), 3) if gpu else None,
        "host_share": round(gauges.get("step_host_ms", 0.0) / interval, 3),
        "codec_busy": gauges.get("codec_busy_seconds_per_s"),
    }
    batch, context = gauges.get("decode_batch_size", 0.0), gauges.get("life_context", 0.0)
    fit = [gauges.get(k) for k in ("step_cost_fixed_ms", "step_cost_token_us", "step_cost_kcontext_us")]
    parts = {}
    if None not in fit:
        a, b, c = fit
        parts = {"fixed": a, "rows": b * batch / 1e3, "context": c * batch * context / 1e6}
        out |= {f"fit_{k}_ms": round(v, 3) for k, v in parts.items()}
    idle = gauges.get("step_gpu_idle_ms", 0.0) / interval
    if (out["codec_busy"] or 0.0) >= BOUND_SHARE:
        out["bound"] = "codec"
    elif out["host_share"] >= BOUND_SHARE and (idle >= 1 - BOUND_SHARE or not gpu):
        out["bound"] = "host"
    elif gpu and out["gpu_busy_share"] >= BOUND_SHARE:
        out["bound"] = "gpu" + (f": {max(parts, key=parts.get)}" if parts else "")
    else:
        out["bound"] = "none"
    return out


def measure_level(
    base: str,
    sample_rate: int,
    ttfa_by_rid: dict | None = None,
    client_procs: int = 1,
    began_by_rid: dict | None = None,
    before: Callable[[], object] | None = None,
    **level,
) -> dict:
    """One load level (`run_level`'s keywords) → its summary, with the server's gauges sampled
    while it ran (`server_during`); each request's TTFA in ms goes into `ttfa_by_rid` if given, and
    its start on the wall clock (time.time(), s) into `began_by_rid`.
    `client_procs` > 1: the level's clients (or its Poisson rate) split over that many processes
    (`run_level_parts`), started together. `before`: called just before the level starts (its
    client processes ready), to start what records it (a tap)."""
    procs = max(1, client_procs)
    children = start_parts(base, procs, level) if procs > 1 else []  # before the sampler's thread
    if before is not None:
        before()
    sampler = GaugeSampler(
        base, BURST_SAMPLE_S if arrivals(level.get("rate"), level.get("ramp", 0.0)) == "burst" else SAMPLE_S
    )
    behind = streams_behind(base)
    lags: list[float] = []  # each client process's largest loop lag over the level (s)
    try:
        if children:
            results, wall = run_level_parts(children, lags)
        else:
            use_uvloop()  # the client's loop reads every stream's chunks: keep its own lag out of the timings
            lag = LoopLag(window_s=math.inf)
            results, wall = asyncio.run(run_level(base, lag=lag, **level))
            lags.append(lag.max_s())
    finally:
        sampler.stop()
    if ttfa_by_rid is not None:
        ttfa_by_rid.update({r.rid: 1000 * r.ttfa for r in results if r.ok and r.chunks})
    if began_by_rid is not None:
        began_by_rid.update({r.rid: r.began for r in results if r.ok and r.chunks})
    summary = summarize(results, wall, sample_rate, ramp := level.get("ramp", 0.0))
    if arrivals(level.get("rate"), ramp) == "burst":
        summary |= burst_waves(results, level.get("concurrency", 0), sample_rate)
    if level.get("cloning") is not None:  # the level's cloned and plain requests apart
        summary |= split(level["cloning"], results, lambda part: summarize(part, wall, sample_rate, ramp))
    # The client's own lag: a process that read its streams late added it to the first audio it measured.
    client = {"client_procs": procs, "client_loop_lag_max_ms": round(1000 * max(lags, default=0.0), 1)}
    # The level's streams whose audio fell behind playback at the gateway, before the network and
    # the client's own reading: late requests beyond these are the client's (None: not known)
    after = streams_behind(base)
    server = {"server_streams_behind": None if behind is None or after is None else round(after - behind)}
    return {**summary, **client, **server, "server_during": sampler.summary()}


def summarize(results: list[Result], wall_s: float, sample_rate: int, ramp_s: float = 0.0) -> dict:
    ok = [r for r in results if r.ok]
    rejected = [r for r in results if r.retry_after_s > 0]
    ttfa = [r.ttfa * 1000 for r in ok if r.chunks]
    # Requests sent after the ramp (the closed loop's steady state) apart, and when the slowest
    # first audio was asked for: tells a start-up burst from a steady tail.
    steady = [r.ttfa * 1000 for r in ok if r.chunks and r.sent_at >= ramp_s]
    worst = max((r for r in ok if r.chunks), key=lambda r: r.ttfa, default=None)
    per_stream = [r.x_realtime(sample_rate) for r in ok if r.chunks]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok) - len(rejected),
        "error_examples": sorted({r.error for r in results if not r.ok and not r.retry_after_s})[:3],
        # refused at admission with 503 and Retry-After (the wait for a stream bounded), not errors
        "rejected": len(rejected),
        "ttfa_p50_ms": round(percentile(ttfa, 50), 2),
        "ttfa_p90_ms": round(percentile(ttfa, 90), 2),
        "ttfa_p95_ms": round(percentile(ttfa, 95), 2),
        "ttfa_p99_ms": round(percentile(ttfa, 99), 2),
        "ttfa_p99_ms_after_ramp": round(percentile(steady, 99), 2) if steady else None,
        "ttfa_worst_sent_at_s": round(worst.sent_at, 2) if worst is not None else None,
        "on_time_share": round(sum(r.on_time(sample_rate) for r in results) / max(1, len(results)), 4),
        # of the requests admitted (served, or failed once admitted): past capacity, what admission kept
        "on_time_share_admitted": round(
            sum(r.on_time(sample_rate) for r in results) / max(1, len(results) - len(rejected)), 4
        ),
        "x_realtime": round(sum(r.audio_s(sample_rate) for r in ok) / wall_s, 2),
        # Each stream's own pace (audio seconds over its seconds from sending to its last chunk):
        # >= 1.0 keeps up with a listener. The median and the slowest stream.
        "x_realtime_per_stream_p50": round(percentile(per_stream, 50), 2) if per_stream else 0.0,
        "x_realtime_per_stream_min": round(min(per_stream), 2) if per_stream else 0.0,
        **late_summary(ok, sample_rate),
        "ttfa_by_sent_second": ttfa_by_sent_second(ok),
        # the requests that opened a connection: how long it took, and how many waited for a SYN
        # retry (the server's accept queue full: part of their TTFA before the server saw them)
        **connect_summary(results),
        "wall_s": round(wall_s, 2),
    }


def burst_waves(results: list[Result], clients: int, sample_rate: int) -> dict:
    """A burst level's requests in two parts: the burst itself (the first request of each of its
    `clients`, the first `clients` sent) and the closed loop's later requests (each client's next
    one as its stream ends: the burst's streams, all of one length, end close together and make a
    second wave), each with its TTFA p50 / p99 and on-time share. The level's own figures are of
    both; these tell the burst's first audio from the waves after it."""
    ordered = sorted(results, key=lambda r: r.sent_at)

    def part(rs: list[Result]) -> dict:
        ttfa = [1000 * r.ttfa for r in rs if r.ok and r.chunks]
        return {
            "requests": len(rs),
            "ttfa_p50_ms": round(percentile(ttfa, 50), 2) if ttfa else None,
            "ttfa_p99_ms": round(percentile(ttfa, 99), 2) if ttfa else None,
            "on_time_share": round(sum(r.on_time(sample_rate) for r in rs) / len(rs), 4) if rs else None,
        }

    return {"burst_wave": part(ordered[:clients]), "after_burst": part(ordered[clients:])}


def connect_summary(results: list[Result]) -> dict:
    """The connections opened (how long, how many waited for a SYN retry) and when the requests went
    out (`send_ms`: from each one's start to its headers written, the part of its TTFA the server
    never sees; in a burst, mostly the client's own event loop getting through the others)."""
    opened = [1000 * r.connect_s for r in results if r.connect_s > 0]
    sent = [1000 * r.send_s for r in results if r.send_s == r.send_s]
    return {
        "connects": len(opened),
        "connect_p99_ms": round(percentile(opened, 99), 1) if opened else None,
        "connects_retried": sum(c >= 1000 * RETRIED_CONNECT_S for c in opened),
        "send_ms_p50": round(percentile(sent, 50), 1) if sent else None,
        "send_ms_p99": round(percentile(sent, 99), 1) if sent else None,
    }


def late_summary(ok: list[Result], sample_rate: int) -> dict:
    """Of the requests with a late chunk: how many, how far behind playback (worst chunk) and how far
    into the stream the first late chunk came, and up to five in detail (`Result.late_detail`)."""
    lateness = [(r, *r.lateness(sample_rate)) for r in ok if r.chunks]
    late = [(w * 1000, first) for _, w, first in lateness if w > 0]
    return {
        "late_requests": len(late),
        "late_worst_ms_p50": round(percentile([w for w, _ in late], 50), 1) if late else 0.0,
        "late_worst_ms_p99": round(percentile([w for w, _ in late], 99), 1) if late else 0.0,
        "first_late_at_s_p50": round(percentile([f for _, f in late], 50), 2) if late else None,
        "late_examples": [r.late_detail(sample_rate) for r, w, _ in lateness if w > 0][:5],
    }


def ttfa_by_sent_second(results: list[Result]) -> dict[str, list]:
    """First audio by the second of the level its request was sent in (lists over seconds with a
    request): how many, p50, p99 and the slowest, in ms. Tells the ramp's end from the rest."""
    by: dict[int, list[float]] = {}
    for r in results:
        if r.chunks:
            by.setdefault(int(r.sent_at), []).append(1000 * r.ttfa)
    secs = sorted(by)
    return {
        "t_s": secs,
        "n": [len(by[s]) for s in secs],
        "p50_ms": [round(percentile(by[s], 50), 1) for s in secs],
        "p99_ms": [round(percentile(by[s], 99), 1) for s in secs],
        "max_ms": [round(max(by[s]), 1) for s in secs],
    }


async def run_level(
    base: str,
    *,
    concurrency: int = 0,
    rate: float = 0.0,
    duration: float,
    tokens: int,
    prompt_allowance: int,
    seed: int,
    ramp: float = 0.0,
    max_errors: int = 0,
    progress_s: float = 0.0,
    texts: str = "mixed",
    cloning: Cloning | None = None,
    part: tuple[int, int] = (0, 1),
    start_at: float = 0.0,
    lag: LoopLag | None = None,
) -> tuple[list[Result], float]:
    """Closed loop (`concurrency` clients, each sending back to back, their first requests spread
    evenly over `ramp` seconds: 0, a burst, every one at once) or open loop (Poisson `rate`). A
    client refused at admission waits its Retry-After, within the level. With `max_errors` > 0 the
    level ends early once that many requests failed (rejections are not failures); with
    `progress_s` > 0 a line on stderr every that many seconds says how far it got. `cloning`: which
    requests carry a new reference clip (bench.clips), and the plain ones' voice. `part` (p, k):
    this is process p of k running the level (`run_level_parts`): it runs the clients i with
    i % k == p (each at its own place in the ramp), or a Poisson stream of rate / k (k of them are
    one of `rate`; the first part's first request at the start, as in one process, the others'
    after a gap), and ends once its own share of `max_errors` failed (the other parts go on), its
    progress lines (the first part's) saying so; `start_at` (perf_counter, one clock for the
    host's processes): when the level starts. `lag`: watches this process's event loop while the
    level runs."""
    p, k = part
    rng = random.Random(seed if k == 1 else seed * 1_000_003 + p)
    cloning = cloning or Cloning()
    if k > 1:
        rate, max_errors = rate / k, -(-max_errors // k)
    url = base + "/generate"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    results: list[Result] = []

    def body() -> dict:
        return {
            "text": rng.choice(TEXT_SETS[texts]),
            "seed": rng.randrange(2**31),
            "max_tokens": tokens + prompt_allowance,
            "min_tokens": tokens,
        }

    level_id = uuid.uuid4().hex[:8] + (f"-{p}" if k > 1 else "")
    rids = (f"load-{level_id}-{n}" for n in itertools.count())
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=auth_headers(), trace_configs=[connect_timing()]
    ) as s:
        while start_at and (wait := start_at - time.perf_counter()) > 0:  # a loop's timer may wake early
            await asyncio.sleep(wait)
        t0 = start_at or time.perf_counter()
        deadline = t0 + duration

        def going() -> bool:
            failed = max_errors > 0 and sum(not r.ok and not r.retry_after_s for r in results) >= max_errors
            return not failed and time.perf_counter() < deadline

        def within(wait_s: float) -> float:
            """`wait_s`, cut at the level's deadline."""
            return min(wait_s, max(0.0, deadline - time.perf_counter()))

        ticker = (  # of several processes, the first reports its part
            asyncio.create_task(_report_progress(results, t0, duration, progress_s, part))
            if progress_s and p == 0
            else None
        )
        watch = asyncio.create_task(lag.run()) if lag is not None else None
        if concurrency:

            async def client(i: int) -> None:
                await asyncio.sleep(ramp * i / concurrency)
                clones = cloning.client_clones(i, concurrency)
                while going():
                    res = await one_request(s, url, cloning.request(body(), clones), t0, next(rids))
                    results.append(res)
                    if res.retry_after_s:  # as a well-behaved client does, within the level
                        await asyncio.sleep(within(res.retry_after_s))

            await asyncio.gather(*(client(i) for i in range(p, concurrency, k)))
        else:
            tasks = []
            if p > 0:  # one Poisson stream of k: one request at the start, as in one process
                await asyncio.sleep(within(rng.expovariate(rate)))
            while going():
                sent = cloning.request(body(), cloning.request_clones(rng))
                tasks.append(asyncio.create_task(one_request(s, url, sent, t0, next(rids))))
                await asyncio.sleep(within(rng.expovariate(rate)))
            results.extend(await asyncio.gather(*tasks))
        for task in (ticker, watch):
            if task is not None:
                task.cancel()
        return results, time.perf_counter() - t0


def add_client_procs(ap) -> None:
    """The `--client-procs` option of the commands that run load levels (`measure_level`)."""
    ap.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes each level's clients (Poisson: its rate) are split over, started together: a burst's "
        "requests then go out side by side as independent clients' do, not one after the other (default 1)",
    )


def start_parts(base: str, procs: int, level: dict) -> list[subprocess.Popen]:
    """`procs` client processes for one level (`run_level`'s keywords), each told its part
    (`run_level`'s `part`) and ready: `run_level_parts` starts them. A burst's clients opening
    their connections and writing their requests in one event loop go out one after the other
    (~60 ms for the median request of 288 on an H100's host: `send_ms`), where independent clients
    would not; several processes do that part side by side."""
    cloning = level.get("cloning")
    plain = {k: v for k, v in level.items() if k != "cloning"}
    clips = None if cloning is None else {
        "share": cloning.share, "voice": cloning.voice, "seconds": cloning.seconds, "nonce": cloning.nonce,
    }  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    children = []
    try:
        for p in range(procs):
            child = subprocess.Popen(
                [sys.executable, "-m", "bench.load", "--part"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=env,
            )  # fmt: skip
            # Its results (hundreds of kB for a long level) go to a file: as one line on the stdout
            # pipe they can arrive cut at 64 KiB (seen on the H100 host; cause not known).
            fd, child.results_path = tempfile.mkstemp(prefix="voxpipe-part-", suffix=".json")
            os.close(fd)
            children.append(child)
            assert child.stdin is not None
            child.stdin.write(
                json.dumps({"base": base, "level": plain, "cloning": clips, "part": [p, procs],
                            "out": child.results_path}) + "\n"
            )  # fmt: skip
            child.stdin.flush()
        for child in children:
            assert child.stdout is not None
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a client process did not start (exit {child.wait()})")
    except BaseException:
        for child in children:
            child.kill()
            child.wait()
            with contextlib.suppress(OSError):
                os.unlink(child.results_path)
        raise
    return children


def run_level_parts(
    children: list[subprocess.Popen], lags: list[float] | None = None
) -> tuple[list[Result], float]:
    """Start the level in every process of `start_parts` at once → all their results, and the
    level's wall time (its longest part's); each process's largest event-loop lag (s) into `lags`."""
    start_at = time.perf_counter() + PART_START_S
    results, wall = [], 0.0
    try:
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"{start_at!r}\n")
            child.stdin.flush()
        for child in children:
            out, _ = child.communicate()
            if child.returncode != 0 or out.splitlines()[-1:] != ["done"]:
                raise RuntimeError(f"a client process of the level failed (exit {child.returncode})")
            with open(child.results_path) as f:
                got = json.load(f)
            wall = max(wall, got["wall"])
            if lags is not None:
                lags.append(got["lag_max_s"])
            results += [Result(**{**r, "chunks": [tuple(c) for c in r["chunks"]]}) for r in got["results"]]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            with contextlib.suppress(OSError):
                os.unlink(child.results_path)
    return results, wall


def _part_main() -> None:
    """A process of a level split over several (`start_parts`): its part on stdin's first line,
    "ready" on stdout, the level's start (perf_counter) on stdin's next line, then its results as
    JSON into the part's file ("out") and "done" on stdout."""
    spec = json.loads(sys.stdin.readline())
    level, clips, part = spec["level"], spec["cloning"], tuple(spec["part"])
    if clips is not None:  # a clip nonce of its own: every cloned request's clip is new
        level["cloning"] = Cloning(
            clips["share"], clips["voice"], clips["seconds"], nonce=clips["nonce"] + part[0]
        )
    use_uvloop()
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    lag = LoopLag(window_s=math.inf)
    results, wall = asyncio.run(run_level(spec["base"], part=part, start_at=start_at, lag=lag, **level))
    out = {"wall": wall, "lag_max_s": lag.max_s(), "results": [dataclasses.asdict(r) for r in results]}
    with open(spec["out"], "w") as f:
        json.dump(out, f)
    print("done", flush=True)


async def _report_progress(
    results: list[Result], t0: float, duration: float, every: float, part: tuple[int, int] = (0, 1)
) -> None:
    of = f" (client process {part[0] + 1} of {part[1]})" if part[1] > 1 else ""
    while True:
        await asyncio.sleep(every)
        errors = sum(not r.ok for r in results)
        elapsed = time.perf_counter() - t0
        print(
            f"  {elapsed:4.0f}/{duration:.0f} s: {len(results)} requests done, {errors} failed{of}",
            file=sys.stderr,
            flush=True,
        )


@dataclass(frozen=True)
class Target:
    """What a level must meet besides no errors and none refused at admission: a share of its
    requests fully on time and a TTFA percentile at most `ttfa_ms`."""

    on_time: float
    pct: int  # the TTFA percentile: a level's `ttfa_p{pct}_ms`
    ttfa_ms: float

    def met(self, point: dict) -> bool:
        return (
            point["errors"] == 0
            and point.get("rejected", 0) == 0
            and point["on_time_share"] >= self.on_time
            and point[f"ttfa_p{self.pct}_ms"] <= self.ttfa_ms
        )

    def text(self) -> str:
        share = "every request" if self.on_time >= 1.0 else f">= {100 * self.on_time:g}% of requests"
        return f"no errors or rejections, {share} fully on time, p{self.pct} TTFA <= {self.ttfa_ms:g} ms"


# The target by how a level's requests arrive: a ramp's is the load curve's of record; a burst (every
# stream at once, from idle) is given a longer first audio, its prompts admitted together, and Poisson
# arrivals of short sentences a shorter one, none of them late.
TARGETS = {
    "ramp": Target(on_time=0.99, pct=99, ttfa_ms=250.0),
    "burst": Target(on_time=1.0, pct=99, ttfa_ms=500.0),
    "poisson": Target(on_time=1.0, pct=95, ttfa_ms=60.0),
}


def meets_target(point: dict) -> bool:
    """Whether a level meets the target of its arrivals (`TARGETS`; a ramp's where it names none)."""
    return TARGETS[point.get("arrivals", "ramp")].met(point)


def target_text(kinds) -> str:
    """The targets of these arrivals, for a result file."""
    given = set(kinds)  # once: `kinds` may be a generator
    kinds = [k for k in TARGETS if k in given] or ["ramp"]
    if len(kinds) == 1:
        return TARGETS[kinds[0]].text()
    return "; ".join(f"{k}: {TARGETS[k].text()}" for k in kinds)


def arrivals(rate: bool, ramp_s: float) -> str:
    """How a level's requests arrive: poisson (open loop), else a closed loop's ramp or burst."""
    return "poisson" if rate else "ramp" if ramp_s > 0 else "burst"


def device_label() -> str:
    """This machine's GPU as nvidia-smi names it (the first), else its CPU: for result files run on
    the machine that serves (`voxpipe bench ttfa`, or `--device` not given)."""
    import platform
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0].strip() if out else f"cpu ({platform.processor() or platform.machine()})"


def plot(curve: list[dict], key: str, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    x = [p[key] for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [p["ttfa_p50_ms"] for p in curve], "o-", label="TTFA p50 (ms)")
    ax.plot(x, [p["ttfa_p99_ms"] for p in curve], "s--", label="TTFA p99 (ms)")
    ax.set_xlabel(key)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * p["on_time_share"] for p in curve], "g^-", label="on time (%)")
    ax2.set_ylabel("% of requests fully on time")
    ax2.set_ylim(0, 105)
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


if __name__ == "__main__" and sys.argv[1:] == ["--part"]:
    _part_main()
