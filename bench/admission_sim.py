"""A closed-loop or open-loop load on a simulated GPU, scheduled by the engine's own pacing: to weigh
admission, sit-out and first-chunk policies before spending GPU time on them.

The parts that decide are the real ones: `gpu_worker.scheduler.pacing.StepClock` measures the steps and gives
the capacity, `SitOut` leaves streams ahead out of slow steps, progressive first chunks wait for
`lead_fits` on the clock's `rows_time_high`, and the gateway admits up to the capacity the engine
last reported. Simplified: each step's time is recorded with its own step (the engine's pipeline
pairs an interval with the step launched two before, `StepClock.tick`), the requests' lives are
known (`Lives` from the fixed prompt and length, where the engine averages what ended), and a
chunk's audio counts when its frame is made. What is simulated is the GPU: a step takes a fixed
part, a part per row growing with its context, a part per prompt (or a batched pass for a step's
prompts beyond its first), and some noise; with `--forward`, the steps timed at startup take what
the H200's forward pass alone takes. The load is bench/load's: `clients` closed-loop clients
started over `ramp_s`, each sending its next request when the last one has finished generating,
until `duration_s`, after the levels `--before` on the same worker (idle between, as `voxpipe
bench ttfa --load` runs its levels on one server). With `--rate`, the load is open-loop instead,
as `voxpipe bench ttfa --rate` sends it: requests of `--tokens` rows (360: ~4.4 s of audio) at the
times of a Poisson process of each rate, for `--duration` (12 s) on a fresh worker, until the last
one ends. With `--codec`, a chunk reaches its listener through the codec worker's passes (`Codec`:
windows gathered as the codec worker gathers them, a pass's time by its windows and their kinds),
and a listener is late where a chunk comes after the audio before it has played; without it, a
constant CODEC_S after the step that made it.

    voxpipe bench sim --clients 400,480 [--h200 [--calibrate]] [--ramp 0] --out /tmp/sim.json
    voxpipe bench sim --clients 448 --batched --forward --ramp 0 --before 64,256 --duration 12 --seeds 1
    voxpipe bench sim --rate 20,40,80 --batched --forward --seeds 1
    voxpipe bench sim --rate 20,40,80,90 --h200-rate --forward --first-audio-sit-out
    voxpipe bench sim --rate 40,80,90 --h200-poisson --forward --codec --first-margin 1.0 --first-audio-sit-out

It reports, per policy and load, what bench/load reports (TTFA p50/p99, the share of requests on
time) and the streams admitted; with `--rate`, TTFA p50/p95/p99, the streams running, the step
interval (mean, p95) and the first chunks' sizes in frames besides (`open_level`). The step model's
constants are fitted to the H200 runs (fp8 weights and cache, the codec beside the LM under MPS):
~4 ms a step at 40 streams, ~10 ms at 340 rows of ~550 tokens, and 416 streams held on time with
about a sixth of them sitting out (bench/results/h200-orpheus-load-sit-out.json). It is a model: it
ranks policies, the GPU decides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from codec_worker.codec import GPU_MAX_BATCH, LEAD_MAX_BATCH
from codec_worker.gather import MARGIN_S, is_urgent, urgent_at
from common.config import CodecSettings, GpuWorkerSettings
from gpu_worker.runner.graphs import decode_buckets
from gpu_worker.scheduler.calibrate import step_differences
from gpu_worker.scheduler.pacing import (
    BORROW_MAX,
    LEAD_MARGIN,
    MIN_SPANS,
    SPAN_QUANTILE,
    StepClock,
    borrowable,
    lead_fits,
    step_allowances,
    switch_fits,
    withheld,
)
from gpu_worker.scheduler.sit_out import FirstAudioSitOut, SitOut
from gpu_worker.scheduler.step_cost import Lives, PromptRoom
from gpu_worker.windows import DELIVERY_S, LANE_ROOM, second_trip_s

ROWS_PER_S = 82.03  # Orpheus: a row is 1/82.03 s of audio; a frame is 7 rows
FRAME, LEADS = 7, (7, 14, 21)
# The per-row time (`rows_time_high` over a frame's rows) at which a first frame goes out alone:
# `lead_fits(FRAME, FRAME / ROWS_PER_S, p, 1.15, DELIVERY_S)` holds for p up to this (7.5 ms).
MARGIN = LEAD_MARGIN  # lead_fits's margin


def one_frame_s(margin: float = MARGIN, delivery_s: float = DELIVERY_S) -> float:
    """The per-row time up to which `lead_fits` with `margin` (and `delivery_s` for the second
    chunk's trip) sends a first frame alone."""
    return (FRAME / ROWS_PER_S - delivery_s) / (FRAME * margin)


ONE_FRAME_S = one_frame_s()
# Rows from a frame's end to the next regular window's (a 28-row window every frame: 21)
REGULAR_WAIT = 21
# A regular window's kind at the codec (codec_worker.codec's `_kind`: 28 rows, all kept)
REGULAR_ROWS = 4 * FRAME
REGULAR_KIND = (REGULAR_ROWS, 0)
FULL_TAIL_KIND = (REGULAR_ROWS, FRAME)  # a tail window after a full window's rows
CODEC_S = 0.010  # a chunk's codec pass and trip to the client
METRICS_S = 0.05  # how often the gateway hears the capacity
IDLE_S = 2.0  # between two levels on one worker


@dataclass
class GPU:
    fixed_ms: float = 3.0  # a step's fixed part (weights, launches, the codec beside it)
    row_us: float = 11.0  # per decode row
    row_us_per_1k_ctx: float = 18.0  # per row, per thousand tokens of its context (attention)
    prompt_ms: float = 0.3  # per prompt prefilled in the step
    # each prompt of a step beyond its first, where more than prompt_ms (a prefill pass of its own,
    # a lane's: ~3.3 ms on the H200 where the first rides the decode step for 1.6); 0 = prompt_ms
    extra_prompt_ms: float = 0.0
    # once per step whose prompts beyond its first share a pass (a batched prefill graph: the pass
    # costs this, each of its prompts extra_prompt_ms more); 0: each prompt a pass of its own
    pass_ms: float = 0.0
    noise: float = 0.06  # relative spread of a step's time
    # A curved GPU: the first `knee` rows cost `row_us_below_knee` each (the GEMMs read the weights
    # whatever the rows), the rest `row_us`; 0 = linear.
    knee: int = 0
    row_us_below_knee: float = 2.0
    # Up to this many prompts beyond a step's first join its pass (a mixed graph's joiners), `join_ms`
    # each; the prompts beyond them as above.
    joiners: int = 0
    join_ms: float = 0.0

    def groups(self, prompts: int) -> int:
        """The groups a step's prompts run in (`StepCost`'s term): the first (and its joiners) alone,
        the rest in one batched pass (with `pass_ms`) or a pass each."""
        rest = max(0, prompts - 1 - self.joiners)
        return min(prompts, 1) + ((rest > 0) if self.pass_ms else rest)

    def step_s(self, ctx: np.ndarray, prompts: int, rng: np.random.Generator | None) -> float:
        """A step of len(ctx) decode rows (each at its context) and `prompts` prompts; without `rng`
        the noiseless time."""
        extra = self.extra_prompt_ms or self.prompt_ms
        joined, rest = min(max(0, prompts - 1), self.joiners), max(0, prompts - 1 - self.joiners)
        ms = self.fixed_ms + self.prompt_ms * min(prompts, 1) + self.join_ms * joined + extra * rest
        ms += self.pass_ms * (rest > 0)
        below = min(len(ctx), self.knee)
        rows_us = self.row_us_below_knee * below + self.row_us * (len(ctx) - below)
        ms += (rows_us + self.row_us_per_1k_ctx * ctx.sum() / 1000) / 1000
        return ms * (1.0 if rng is None else max(0.5, 1 + self.noise * rng.standard_normal())) / 1000


# The H200 as its load runs read it (fp8, MPS, a prompt riding the decode step): its startup
# differences (bench/results/h200-orpheus-load-curve.json), the rows' part raised to what
# the fit reads under load (the codec beside the steps). Simulated, 480 clients fill ~437 streams
# (~450 with `calibrate`), all on time, where the H200 held ~421; and a first ramp to 400 admits
# every stream with or without the startup differences, where the H200's fit (after single-stream
# requests, with the codec) held some back without them.
H200 = GPU(fixed_ms=3.0, row_us=15.5, row_us_per_1k_ctx=11.0, prompt_ms=1.6, knee=128, row_us_below_knee=2.0)
# The H200's startup steps (gpu_worker/scheduler/calibrate.py: the forward pass alone, without the
# sampling, the host's work and the codec beside it), fitted to a serve log's four: 256 rows at 128
# and 1024 tokens of context 4.18 and 7.27 ms, 512 rows 6.24 and 12.12 ms. The whole steps served
# take more (H200: at 352 rows ~1.3x), so a fit seeded from these alone starts optimistic.
# ... whose prompts beyond a step's first share a batched prefill graph (one bucket: up to 8 of them,
# so 1 + 8 a step): a pass of 2.7 ms and 0.6 ms a prompt, which is what the H200's fit reads in a
# burst of 256 (2.0-2.2 ms a prompt at 2-3 prompts a step: 1.6 + 2.7 + 0.6 (k - 1) over k prompts
# is 2.2 ms at k = 2.5), and the fixed part it reads there, 3.4 ms.
H200_BATCHED = dataclasses.replace(H200, fixed_ms=3.4, extra_prompt_ms=0.6, pass_ms=2.7)
# The H200's step as its fit reads open-loop arrivals of short requests (the joiners server of
# bench/results/h200-orpheus-mixed-joiners.json: Poisson at 80 req/s, 360 rows a request, ~228
# streams at ~243 tokens of context, 7.1 ms a step): 3.4 ms fixed, 9.9 us a token, 12.2 us per
# thousand tokens of context, linear in the rows; a step's second prompt joins its first's mixed
# graph for 0.9 ms (its startup steps: two joiners +1.88 ms), the rest share a batched pass as
# H200_BATCHED's. H200's knee (rows below 128 at 2 us) is fitted to 340-416 rows of ~550 tokens,
# and between 128 and 250 rows of short context makes steps ~1 ms (at 150 rows ~1.4 ms) shorter
# than the H200's there. Simulated at 80 req/s (5 seeds): ~184 streams, 6.5 ms a step (p95 8.4),
# first chunks of two frames for a third of the requests, TTFA p50 / p95 61 / 114 ms, where the
# H200 runs ~225 streams at ~7 ms with most first chunks of two frames (TTFA p50 ~132 ms): its step
# at a given load is the H200's, the load it settles at lower; at 90 req/s it runs ~228 streams at
# 7.2 ms, three quarters of first chunks of two frames, TTFA p50 114 ms.
# The first-chunk levers on it, worst of 5 seeds (TTFA p50/p95/p99 ms, first chunks of one frame,
# the second chunk's least slack: the first chunk's audio left when it is made, which the engine
# promises DELIVERY_S of), every request on time in each (×real time as the baseline's):
#   policy                       80 req/s                 90 req/s
#   baseline                     64/119/125 66 % 27 ms    116/131/138 26 % 25 ms
#   --first-quantile 0.9 / 0.8   62/118/125 82 % 26 ms    116/131/136 31 %  8 ms
#                                61/118/125 90 % 25 ms    116/131/136 43 %  8 ms
#   --first-margin 1.0           60/70/74  100 % 25 ms     67/127/136 92 %  8 ms (1.6 % < 25 ms)
#   --prompts-while-first 1      65/128/142 87 % 30 ms    123/157/167 28 % 29 ms
#   --prompts-while-first 2      60/116/122 88 % 26 ms    115/129/135 31 % 27 ms
#   --first-audio-sit-out        59/108/115 94 % 30 ms     64/137/146 78 % 25 ms (107 of 315 out)
#     with --first-margin 1.0    60/67/72  100 % 27 ms     64/72/77  100 % 24 ms (51 of 287 out)
#     with --prompts-while-first 2  59/64/68 100 % 32 ms   64/134/147 83 % 16 ms
# At 60 req/s every first chunk is of one frame in each (TTFA p50 ~52 ms); the prompt cap of 1
# costs ~9 ms at p99 there. The margin moves the bound (7.49 to 8.62 ms a row) past the p95 spans
# of 80-90 req/s; a lower quantile leaves the bound and the spans' tail where they are. What it
# spends is the second chunk's slack: the sim's codec trip is a constant CODEC_S, so no second
# chunk comes late here, while on the GPU a second trip slower than the first by more than the
# slack (down to 8 ms, 1.6 % of them under 25 ms at 90 req/s; 2.4 % with the steps' noise doubled)
# is an underrun. The sit-out beside it holds the spans down and the slack up. It is a model: it
# ranks the levers, the GPU decides.
#   voxpipe bench sim --rate 60,80,90 --h200-rate --forward --seeds 5 --first-quantile 0.9,0.8
#     --first-margin 1.0 --prompts-while-first 1,2 --first-audio-sit-out
H200_RATE = dataclasses.replace(
    H200_BATCHED, row_us=9.9, row_us_per_1k_ctx=12.2, knee=0, joiners=1, join_ms=0.9
)
# The H200's step as it served Poisson arrivals at 80 req/s (the same run): H200_RATE settles at
# ~180 streams stepping 6.5 ms where the H200 ran ~228 at 7.2 ms (sent rows at 1.59x real time per
# stream), with most first chunks of two frames and TTFA p50 ~136 ms. A step ~0.7 ms longer than the
# fit reads there (the sampling and the host's share of each interval, which a fit over a level
# that grows from idle spreads over its terms) moves the load the simulation settles at to the
# H200's: with the codec's passes (`--codec`, worst of three seeds), ~230 streams, 81 % of first
# chunks of two frames, TTFA p50 / p95 126 / 143 ms (the H200's 136 / 163 ms include the gateway,
# the prompt builder and the HTTP trips, which the simulation leaves out;
# bench/results/sim-orpheus-poisson-h200-load.json).
H200_POISSON = dataclasses.replace(H200_RATE, fixed_ms=4.1)
H200_FORWARD = GPU(fixed_ms=2.28, row_us=5.94, row_us_per_1k_ctx=13.1, prompt_ms=1.6, noise=0.0)


@dataclass
class Codec:
    """The codec worker (`--codec`): windows gathered as codec_worker/gather.py gathers them (until
    the earliest deadline, `max_wait_s` after the first, or a full batch), each pass decoding every
    window waiting, the urgent requests' (`is_urgent`: no slack, a first chunk or a stream running
    late, or less left than a pass takes and the margin) in a group of their own ahead of the rest;
    within a group each kind of window (the codec worker's `_kind`: a first chunk of 1-3 frames, a
    tail window after 14, 21 or 28 rows, a regular window; graphs of their own) costs `launch_ms`, a
    regular window `window_ms` (the compiled decode) and any other `graph_window_ms`. A window's
    audio reaches its listener `trip_s` after its group ends; the listener starts playing at its
    first chunk's and is late where a later chunk comes after the audio before it has played. The
    constants are the H200's as its runs read them (fp8 LM beside the codec under MPS, half the SMs
    its share, float16 SNAC windows in calls of 16): bursts' passes of ~120 windows, mostly regular
    ones, 14-18 ms and those of ~70 11 ms (`server_during` of
    h200-orpheus-load-curve.json, -burst-*.json, -late-launch.json); at 80 req/s (Poisson, with
    H200_POISSON) ~55 passes a second of ~70 windows, busy ~0.84, where the H200 made ~49 of ~85,
    busy 0.84 (h200-orpheus-mixed-joiners.json). A window that arrives during a pass counts, in the
    codec worker, from the drain before it (codec_worker/worker.py), so its deadlines come a little
    sooner than here."""

    launch_ms: float = 2.5
    window_ms: float = 0.1  # a regular window (the compiled decode)
    graph_window_ms: float = 0.2  # any other kind (captured graphs: ~2x the compiled decode's time)
    # each part of a kind beyond its first where it decodes in graphs of up to LEAD_MAX_BATCH windows
    # (lead and tail windows), replayed in turn: not measured
    # apart on the H200. 0.25 ms keeps its bursts of 256 on time and leaves those of 384 partly late
    # (81-84 % on time with the engine's policy; the H200's 50-95 %); 0 to 1 ms gives 96 to 47 %
    # (bench/results/sim-orpheus-burst-codec.json).
    part_ms: float = 0.25
    # `--codec-compile-tails`: a full window's tail (28 rows, its last frame kept) decodes as a
    # regular window does (compiled, in graphs up to the codec's largest batch)
    compiled_tails: bool = False
    # `--codec-first-lane`: a first chunk (lane 1), and a second chunk too (lane 2), arriving while
    # a pass decodes is decoded at once beside it, `lane_ms` alone, but done no sooner than the pass
    # (an H100 runs a few lane windows in ~3.5 ms alone, and lane graphs launched beside a pass of
    # 128 windows end when it does: tests/gpu/test_gpu_codec_first_lane.py)
    lane: int = 0
    lane_ms: float = 3.5
    max_wait_s: float = CodecSettings().gather_ms / 1000  # --codec-gather-ms
    margin_s: float = MARGIN_S
    full_batch: int = GPU_MAX_BATCH  # the codec's largest batch on a GPU
    trip_s: float = 0.003  # codec worker → gateway → client

    def __post_init__(self) -> None:
        # (arrival, slack, request, audio before, its kind: (rows, tail rows kept or 0), first chunk)
        self.waiting: list[tuple[float, float, dict, float, tuple[int, int], bool]] = []
        self.busy_until = 0.0
        self.decode_s = 0.0  # a slowly forgotten maximum of recent passes (Gather.decode_s)
        self.passes: list[tuple[float, float, int]] = []  # (start, seconds, windows)
        self.first_waits: list[tuple[float, float]] = []  # (a first chunk's arrival, → its audio heard)

    def add(
        self,
        r: dict,
        t: float,
        slack_s: float,
        audio_before_s: float,
        kind: tuple[int, int],
        first: bool = False,
        second: bool = False,
    ) -> None:
        """A window of request `r` leaving the gpu_worker at `t` (its listener's slack then, the audio
        its listener has before it, its kind as the codec worker's `_kind`: (rows, tail rows kept or
        0); `first`: the request's first chunk, `second`: its second). The first lane takes what it
        decodes at once while a pass runs."""
        if t < self.busy_until and (self.lane >= 1 and first or self.lane >= 2 and second):
            self._heard(t, max(t + self.lane_ms / 1000, self.busy_until), r, audio_before_s, first)
            return
        self.waiting.append((t, max(0.0, slack_s), r, audio_before_s, kind, first))

    def _due(self) -> float:
        arrivals = [w[0] for w in self.waiting]
        due = min(arrivals) + self.max_wait_s
        # a window's deadline (no earlier than it arrived: the worker sees it then)
        due = min(
            due, min(max(a, urgent_at(a, sl, self.decode_s, self.margin_s)) for a, sl, *_ in self.waiting)
        )
        if len(self.waiting) >= self.full_batch:
            due = min(due, sorted(arrivals)[self.full_batch - 1])
        return due

    def advance(self, t: float) -> None:
        """Run every pass that starts by `t`."""
        while self.waiting:
            start = max(self._due(), self.busy_until)
            if start > t:
                return
            self._pass(start)

    def flush(self) -> None:
        while self.waiting:
            self._pass(max(self._due(), self.busy_until))

    def _pass(self, start: float) -> None:
        taken = [w for w in self.waiting if w[0] <= start]
        if not taken:  # the earliest window arrives after the codec frees up: start then
            start = min(w[0] for w in self.waiting)
            taken = [w for w in self.waiting if w[0] <= start]
        self.waiting = [w for w in self.waiting if w[0] > start]
        urgent_ids = {id(w[2]) for w in taken if is_urgent(w[1], start - w[0], self.decode_s, self.margin_s)}
        urgent = [w for w in taken if id(w[2]) in urgent_ids]
        rest = [w for w in taken if id(w[2]) not in urgent_ids]
        t = start
        as_regular = {REGULAR_KIND, FULL_TAIL_KIND} if self.compiled_tails else {REGULAR_KIND}
        for group in (urgent, rest):
            if not group:
                continue
            counts = Counter(w[4] for w in group)
            regular = sum(n for kind, n in counts.items() if kind in as_regular)
            # a kind decoded in graphs of up to LEAD_MAX_BATCH windows replays one per part, in turn
            parts = sum(
                math.ceil(n / LEAD_MAX_BATCH) - 1 for kind, n in counts.items() if kind not in as_regular
            )
            windows = self.window_ms * regular + self.graph_window_ms * (len(group) - regular)
            t += (self.launch_ms * len(counts) + self.part_ms * parts + windows) / 1000
            for arrival, _, r, before, _, first in group:
                self._heard(arrival, t, r, before, first)
        self.decode_s = max(t - start, 0.95 * self.decode_s)
        self.passes.append((start, t - start, len(taken)))
        self.busy_until = t

    def _heard(self, arrival: float, decoded: float, r: dict, before: float, first: bool) -> None:
        """A window of `r` that arrived at `arrival` decoded at `decoded`: its listener hears it a
        trip later (a first chunk starts the playback; a later one is late past the audio before it)."""
        heard = decoded + self.trip_s
        if first:
            r["heard"] = heard
            self.first_waits.append((arrival, heard - arrival))
        else:
            r["late"] = max(r["late"], heard - (r["heard"] + before))

    def figures(self, t0: float, t1: float) -> dict:
        """The codec's passes from `t0` to `t1`: a second's passes and busy share, windows a pass,
        and a first chunk's wait from the gpu_worker to its listener (p50 / p95 ms)."""
        passes = [p for p in self.passes if t0 <= p[0] < t1]
        span = max(t1 - t0, 1e-9)
        waits = np.array([w for a, w in self.first_waits if t0 <= a < t1] or [0.0])
        return {
            "codec_passes_per_s": round(len(passes) / span, 1),
            "codec_busy_share": round(sum(p[1] for p in passes) / span, 3),
            "codec_windows_per_pass": round(float(np.mean([p[2] for p in passes])), 1) if passes else 0.0,
            "codec_first_wait_p50_ms": ms(np.percentile(waits, 50)),
            "codec_first_wait_p95_ms": ms(np.percentile(waits, 95)),
        }


def startup_differences(gpu: GPU, steps: dict[int, float] | None = None) -> list:
    """What the engine measures at startup (gpu_worker.scheduler.calibrate), on the simulated GPU
    (`steps`: the startup steps' times, as `step_differences` gives them)."""

    class Runner:
        sizes = decode_buckets(512)

        @staticmethod
        def prompt_groups(rows: list[int]) -> int | None:  # lane 0 and a batched graph of 8, or 4 lanes
            return gpu.groups(len(rows)) if len(rows) <= (9 + gpu.joiners if gpu.pass_ms else 4) else None

    def timer(_, b) -> float:
        decode = np.array(b.kv_lens[b.num_prefill :], dtype=float) - 1  # context before the step
        return gpu.step_s(decode, b.num_prefill, None)

    return step_differences(Runner(), 1 + 512 * 70, 16, 1200, 1, timer=timer, steps=steps)


@dataclass
class Worker:
    """One gpu_worker on a simulated GPU, its clock kept across the levels it serves, and its policy:
    a step starts at most `prompts_a_step` prompts, and with `room` no more than the fitted step cost
    leaves room for beside the running streams (`StepCost.prompt_room`, as the scheduler; at least
    one), each prompt charged the fitted cost or, with `gpu_charge`, what the GPU's own prompts cost
    (the first riding the decode step, the rest in one batched pass: `GPU.pass_ms`); admission from
    the streams' `life` (else the pace alone)."""

    gpu: GPU
    clock: StepClock
    sit: SitOut | None
    rng: np.random.Generator
    life: bool = True
    prompts_a_step: int = 4
    room: bool = True
    tokens: int = 1024
    prompt_len: int = 40
    gpu_charge: bool = False
    rows: int = 0  # the last step's rows
    first_audio: FirstAudioSitOut | None = None
    cap: float = 512.0  # the capacity the worker last reported
    # The first-chunk decision (`lead_fits` on the frame's span): the span quantile and the margin
    # (the engine's: SPAN_QUANTILE, MARGIN), `--first-quantile` / `--first-margin`
    first_quantile: float = SPAN_QUANTILE
    first_margin: float = MARGIN
    # while a running stream waits for its first chunk, a step starts at most this many prompts
    # (`--prompts-while-first`; 0: as `prompts_now`)
    prompts_while_first: int = 0
    # a step's prompts may take what its playing streams can spare beyond the budget (`--lead-borrow`)
    lead_borrow: bool = False
    lead_borrow_max: float = BORROW_MAX  # the most a borrowing step takes, in budgets (`--lead-borrow-max`)
    now: float = 0.0  # the time of the next step
    # the codec worker's passes (`Codec`); None: every chunk reaches its listener CODEC_S after the
    # step that made it
    codec: Codec | None = None
    # what the first-chunk decision allows for a second chunk's trip beyond the first's (the
    # engine's DELIVERY_S; less where the first lane decodes second chunks at once, and only while
    # the streams are within LANE_ROOM of the capacity: `trip_s`)
    delivery_s: float = DELIVERY_S
    load: float = 0.0  # the streams admitted over the capacity the worker last reported
    lane_room: float = LANE_ROOM  # ... up to which `delivery_s` holds (`--codec-first-lane-room`)
    # the room the last `prompts_now` had where the fit bounded it, what it may borrow with it
    fitted: PromptRoom | None = None

    def trip_s(self) -> float:
        """What a first chunk sent now allows for the second's trip, as the engine's windows weigh it:
        `delivery_s` within `lane_room` of the capacity, else no less than DELIVERY_S."""
        return second_trip_s(self.load, self.lane_room, self.delivery_s)

    def prompts_now(self, run: dict[int, dict], waiting: int = 2) -> int:
        """Prompts the next step may start beside the `run`ning streams, `waiting` prompts waiting
        (it borrows only where more than the first wait, as the scheduler's `prompt_room`)."""
        k, n = self.prompts_a_step, self.prompt_len
        budget = self.clock.budget
        fit = self.clock.cost.prompt_room(budget, len(run), sum(n + r["gen"] for r in run.values()))
        self.fitted = None
        if self.room and run and fit is not None:
            borrow, keep = self.allowances(run, budget)
            slow = self.clock.slowness()
            borrowed = (
                borrowable(borrow, budget, slow, self.lead_borrow_max)
                if self.lead_borrow and waiting > 1
                else 0.0
            )
            self.fitted = dataclasses.replace(fit, borrowed=borrowed)
            room = fit.room + borrowed - withheld(keep, budget)
            g, more = self.gpu, 1  # the first prompt, then as many more as the room leaves
            if not self.gpu_charge:  # as the scheduler: the fitted cost of a prompt and the group it opens
                spent = self.prompt_cost(fit, 0)
                while more < k and spent + (c := self.prompt_cost(fit, more)) <= room:
                    spent, more = spent + c, more + 1
                return more
            while (
                more < k
                and g.prompt_ms + g.pass_ms + (g.extra_prompt_ms or g.prompt_ms) * more <= 1000 * room
            ):
                more += 1
            return more
        return k

    def allowances(self, run: dict[int, dict], budget: float) -> tuple[float, float]:
        """What the next step may take with every playing stream's next frame in time (the
        scheduler's `allowances`): every playing stream's audio in hand (since its chunk left,
        CODEC_S before it arrived) and the rows until its next frame's chunk, the other rows at
        least `budget` each (what it may borrow on) and at the clock's pace (what it may take of
        the budget)."""
        playing = [
            (r["sent_audio"] - (self.now - r["first"] + CODEC_S), FRAME - r["gen"] % FRAME)
            for r in run.values()
            if r["first"] is not None
        ]
        return step_allowances(playing, self.clock.rows_time_high, self.first_margin, DELIVERY_S, budget)

    def prompts_next(self, run: dict[int, dict], waiting: int = 2) -> int:
        """`prompts_now`, at most `prompts_while_first` while a running stream waits for its first
        chunk: the steps of its frame then carry no batched prefill pass (nor, at 1, a joiner)."""
        k = self.prompts_now(run, waiting)
        if self.prompts_while_first and any(r["first"] is None for r in run.values()):
            return min(k, self.prompts_while_first)
        return k

    def expected(self, started: int, left: bool) -> float:
        """What the next steps may take once a step has started `started` prompts, prompts still
        waiting or not (`left`): as the scheduler tells its clock after its admission
        (`PromptRoom.expected`), the prompts at their fitted cost."""
        fit = self.fitted or PromptRoom(math.inf)  # unbounded: its prompts cost nothing of it
        spent = sum(self.prompt_cost(fit, i) for i in range(started))
        return fit.expected(spent, left, self.clock.budget, self.clock.slowness())

    def prompt_cost(self, fit: PromptRoom, i: int) -> float:
        """The fitted cost of a step's `i`-th prompt (from 0): its tokens and the groups it opens on
        the simulated GPU's graphs (the first a group of its own)."""
        g = self.gpu
        return fit.cost(self.prompt_len, 1 if i == 0 else g.groups(i + 1) - g.groups(i))

    def first_period_high(self, rows: int) -> float:
        """The per-row time the first-chunk decision weighs over `rows` steps: the clock's
        `rows_time_high`, at `first_quantile` (`span_high`)."""
        if self.first_quantile == SPAN_QUANTILE:
            return self.clock.rows_time_high(rows) / rows
        return span_high(self.clock, rows, self.first_quantile) / rows


def span_high(clock: StepClock, rows: int, q: float) -> float:
    """`StepClock.rows_time_high` with the quantile `q` in place of SPAN_QUANTILE (its steps read
    from the clock): the q-quantile of the times of every `rows` consecutive steps among the last
    RECENT_STEPS or the latest span if slower, no less than the clock's `expect`."""
    dts = clock._dts
    if len(dts) < rows + MIN_SPANS:
        high = rows * clock.row_period_high()
    else:
        ends = np.cumsum(np.fromiter(dts, float, len(dts)))
        spans = ends[rows - 1 :] - np.concatenate([[0.0], ends[:-rows]])
        high = max(float(np.quantile(spans, q)), float(spans[-1]))
    return max(high, rows * clock._expected)


def simulate(
    clients: int,
    *,
    tokens: int = 1024,
    ramp_s: float = 8.0,
    duration_s: float = 20.0,
    seed: int = 0,
    before: tuple[int, ...] = (),
    **worker,
) -> dict:
    """`clients` closed-loop clients (all at once where `ramp_s` is 0: a burst) of `tokens` rows each
    on a fresh worker (its GPU and policy: `new_worker`'s keywords), after the levels of clients
    `before` on the same worker (each for `duration_s`, idle between: as `voxpipe bench ttfa --load`
    runs its levels on one server). → the last level's figures."""
    w = new_worker(tokens=tokens, seed=seed, **worker)
    t = 0.0
    for n in before:
        t = level(w, n, t, ramp_s, duration_s)["t_end"] + IDLE_S
        w.clock.tick(0)
    return level(w, clients, t, ramp_s, duration_s)


def simulate_poisson(
    rate: float, *, tokens: int = 360, duration_s: float = 12.0, seed: int = 0, **worker
) -> dict:
    """Requests of `tokens` rows arriving open-loop at `rate` a second (Poisson) for `duration_s` on a
    fresh worker (its GPU and policy: `new_worker`'s keywords), until the last one ends. → figures as
    `voxpipe bench ttfa --rate` reports them (`open_level`)."""
    w = new_worker(tokens=tokens, seed=seed, **worker)
    return open_level(w, rate, 0.0, duration_s, np.random.default_rng([seed, 1]))


def first_audio_sit_out(w: Worker) -> FirstAudioSitOut:
    """The first-audio policy on `w`'s clock, streams with the sit-out's audio in hand sitting out,
    steps held under the one-frame pace of `w`'s first-chunk margin and the trip it allows now."""
    lead = GpuWorkerSettings().sit_out_lead_s
    return FirstAudioSitOut(
        w.clock, decode_buckets(512), lead, bound=lambda: one_frame_s(w.first_margin, w.trip_s())
    )


def new_worker(
    *,
    gpu: GPU | None = None,
    life: bool = True,
    sit_out: bool = True,
    tokens: int = 1024,
    prompt_len: int = 40,
    seed: int = 0,
    calibrate: bool = False,
    startup: GPU | None = None,
    prompts_a_step: int = 4,
    room: bool = True,
    gpu_charge: bool = False,
    first_audio: bool = False,
    first_quantile: float = SPAN_QUANTILE,
    first_margin: float = MARGIN,
    prompts_while_first: int = 0,
    lead_borrow: bool = False,
    lead_borrow_max: float = BORROW_MAX,
    trust_startup: bool = False,
    codec: bool = False,
    compiled_tails: bool = False,
    codec_part_ms: float | None = None,
    codec_lane: int = 0,
    delivery_s: float = DELIVERY_S,
    lane_room: float = LANE_ROOM,
) -> Worker:
    """A fresh worker on `gpu` (default `GPU()`), its clock `calibrate`d from startup steps timed on
    `startup` (default `gpu`), its steps' noise drawn from `seed`, its requests `tokens` rows after
    prompts of `prompt_len`; a step starts prompts as `Worker` says (`prompts_a_step`, `room`,
    `gpu_charge`, admission by `life`), streams ahead sit out slow steps (`sit_out`) and, with
    `first_audio`, for first chunks (`FirstAudioSitOut`); the first-chunk decision at
    `first_quantile` and `first_margin`, at most `prompts_while_first` prompts a step while a first
    chunk waits, a step's prompts taking what the playing streams spare with `lead_borrow` (up to
    `lead_borrow_max` budgets a step), and the
    startup steps counted as measured with `trust_startup` (`--trust-startup-steps`); with `codec`,
    the codec worker's passes between the steps and the listeners (`Codec`; `compiled_tails`: its
    full windows' tails compiled, `--codec-compile-tails`; `codec_part_ms`: its `part_ms`;
    `codec_lane`: its first lane, `Codec.lane`), the first-chunk decision allowing `delivery_s` for
    a second chunk's trip while the streams are at most `lane_room` of the capacity."""
    gpu = gpu or GPU()
    clock = StepClock(ROWS_PER_S, 512, trust_startup=trust_startup)
    if calibrate:
        steps: dict[int, float] = {}
        clock.cost.calibrate(startup_differences(startup or gpu, steps))
        clock.seed(steps, now=0.0)
    sit = SitOut(clock, decode_buckets(512), GpuWorkerSettings().sit_out_lead_s) if sit_out else None
    rng = np.random.default_rng(seed)
    w = Worker(gpu, clock, sit, rng, life, prompts_a_step, room, tokens, prompt_len, gpu_charge)
    w.first_quantile, w.first_margin, w.prompts_while_first, w.lead_borrow = (
        first_quantile,
        first_margin,
        prompts_while_first,
        lead_borrow,
    )
    w.lead_borrow_max, w.delivery_s, w.lane_room = lead_borrow_max, delivery_s, lane_room
    w.first_audio = first_audio_sit_out(w) if first_audio else None
    w.codec = None
    if codec:
        part = {} if codec_part_ms is None else {"part_ms": codec_part_ms}
        w.codec = Codec(compiled_tails=compiled_tails, lane=codec_lane, **part)
    return w


class Clients:
    """Closed-loop arrivals: `clients` clients started over `ramp_s` from `t0`, each sending its next
    request when the last one has finished generating, until `end`."""

    def __init__(self, clients: int, t0: float, ramp_s: float, end: float) -> None:
        self.clients, self.end = clients, end
        self.next_send = [t0 + i * ramp_s / clients for i in range(clients)]

    def due(self, t: float) -> list[tuple[int, float]]:
        """(client, sent at) of the requests sent by `t`."""
        sent = []
        for c in range(self.clients):
            if self.next_send[c] <= t and self.next_send[c] < self.end:
                sent.append((c, self.next_send[c]))
                self.next_send[c] = math.inf
        return sent

    def idle_until(self, t: float) -> float:
        """Where the worker, idle at `t`, next has a request to wait for."""
        later = [s for s in self.next_send if s < self.end]
        return min(later) if later else max(t, self.end)

    def finished(self, c: int, t: float) -> None:
        self.next_send[c] = t + 0.005


class Poisson:
    """Open-loop arrivals: requests at the times of a Poisson process of `rate` a second from `t0`
    until `end`, whatever the worker serves."""

    def __init__(self, rate: float, t0: float, end: float, rng: np.random.Generator) -> None:
        gaps = rng.exponential(1.0 / rate, size=int(rate * (end - t0) * 1.5) + 64)
        times = t0 + np.cumsum(gaps)
        while times[-1] < end:  # rarely: more arrivals than the draw held
            times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, 64))])
        self.times, self.end, self.i = [float(x) for x in times[times < end]], end, 0

    def due(self, t: float) -> list[tuple[int, float]]:
        """(request, sent at) of the requests sent by `t`."""
        sent = []
        while self.i < len(self.times) and self.times[self.i] <= t:
            sent.append((self.i, self.times[self.i]))
            self.i += 1
        return sent

    def idle_until(self, t: float) -> float:
        return self.times[self.i] if self.i < len(self.times) else max(t, self.end)

    def finished(self, c: int, t: float) -> None:
        pass


@dataclass
class Served:
    """What a level's requests and steps did: the requests `done`, the streams each step `served`
    (its rows and those sitting out), `steps` (start, seconds, rows), the capacity the gateway
    heard while requests came (`caps`), the most streams admitted at once, and the time it ended."""

    done: list[dict]
    served: list[int]
    steps: list[tuple[float, float, int]]
    caps: list[float]
    admitted_max: int
    t_end: float


def serve(w: Worker, arrivals: Clients | Poisson, t0: float, end: float) -> Served:
    """The worker's steps from `t0`, the gateway admitting `arrivals` up to the capacity the worker
    last reported, until the requests sent by `end` have all ended."""
    t, cap, cap_at = t0, float(512), -1.0
    clock, run, tokens, prompt_len = w.clock, {}, w.tokens, w.prompt_len  # run: request id → it
    queue: list[tuple[int, float]] = []  # (request id, sent at) waiting at the gateway
    waiting: list[tuple[int, float]] = []  # admitted, not yet prefilled
    done: list[dict] = []
    admitted_max, served, steps, caps = 0, [], [], []
    sending = True
    while sending or queue or waiting or run:
        queue.extend(arrivals.due(t))
        if t - cap_at >= METRICS_S:
            cap = clock.capacity(
                now=t, lives=Lives(prompt_len + tokens / 2, prompt_len, tokens) if w.life else None
            )
            cap_at, w.cap = t, cap
            if t < end:
                caps.append(cap)
        while queue and len(run) + len(waiting) < cap:
            waiting.append(queue.pop(0))
        w.now, w.load = t, (len(run) + len(waiting)) / max(cap, 1.0)
        k = w.prompts_next(run, len(waiting))
        new, waiting = waiting[:k], waiting[k:]
        clock.expect(w.expected(len(new), bool(waiting)))  # as the scheduler after its admission
        for c, sent in new:
            run[c] = dict(sent=sent, gen=0, first=None, late=0.0, admitted=t, prompt=True, cap=cap)
        admitted_max = max(admitted_max, len(run) + len(waiting))
        if not run:
            t = arrivals.idle_until(t)
            clock.tick(0)
            sending = t < end
            continue
        dt = step(w, run, t)
        steps.append((t, dt, w.rows))
        t += dt
        served.append(len(run))
        if w.codec is not None:
            w.codec.advance(t)
        for c in list(run):
            r = run[c]
            if r["first"] is not None and w.codec is None:
                # audio in hand when the newest chunk arrives (it left CODEC_S ago at the latest)
                r["late"] = max(r["late"], (t + CODEC_S - r["first"]) - r["sent_audio"] - CODEC_S)
            if r["gen"] >= tokens:
                done.append(run.pop(c))
                arrivals.finished(c, t)
        sending = t < end
    if w.codec is not None:
        w.codec.flush()
    return Served(done, served, steps, caps, admitted_max, t)


def level(w: Worker, clients: int, t0: float, ramp_s: float, duration_s: float) -> dict:
    """`clients` closed-loop clients from `t0` (seconds on the worker's clock) for `duration_s`, until
    the last request ends. → figures as bench/load reports them, and `t_end`."""
    end = t0 + duration_s
    s = serve(w, Clients(clients, t0, ramp_s, end), t0, end)
    done, served, caps, clock = s.done, s.served, s.caps, w.clock
    ttfa = np.array([heard(r) - r["sent"] for r in done])
    wait = np.array([r["admitted"] - r["sent"] for r in done])
    late = np.array([r["late"] for r in done])
    return {
        "clients": clients,
        "requests": len(done),
        "ttfa_p50_ms": ms(np.percentile(ttfa, 50)),
        "ttfa_p99_ms": ms(np.percentile(ttfa, 99)),
        "ttfa_max_ms": ms(ttfa.max()),
        "wait_p99_ms": ms(np.percentile(wait, 99)),
        "on_time_share": round(float((late <= 0.0).mean()), 4),
        "worst_late_ms": ms(late.max()),
        "admitted_max": s.admitted_max,
        "served_mean": round(float(np.mean(served[len(served) // 3 : 2 * len(served) // 3])), 1),
        "capacity_min": round(min(caps), 1),
        "capacity_p50": round(float(np.median(caps)), 1),
        "capacity_max": round(max(caps), 1),
        "cost_fit": [round(x * 1e6, 2) for x in clock.cost.coefficients() or ()],
        **(w.codec.figures(t0, end) if w.codec is not None else {}),
        "t_end": s.t_end,
    }


def heard(r: dict) -> float:
    """When request `r`'s first audio reached its listener: from the codec's passes (`Codec`), else
    CODEC_S after the step that made it."""
    return r.get("heard", r["first"])


def open_level(w: Worker, rate: float, t0: float, duration_s: float, rng: np.random.Generator) -> dict:
    """Requests arriving at `rate` a second (Poisson, drawn from `rng`) from `t0` for `duration_s`,
    until the last one ends. → figures as bench/load reports them for `--rate`: TTFA over every
    request (and over those sent in the second half, the load grown), the share on time, the streams
    running, the step interval (each running stream's row period but while it sits out) and
    throughput; and the first chunks' sizes in frames with the per-row time `lead_fits` weighed
    where a first frame was ready (`StepClock.rows_time_high` over a frame's rows: at most
    `ONE_FRAME_S` sends it alone); and the second chunks' slack: the first chunk's audio left when
    the second is made, the most its trip may take beyond the first's (the least, the 1st
    percentile, and the share below the trip `lead_fits` promised it, `Worker.trip_s`; and the share
    of first chunks sent on the first lane's shorter trip, within LANE_ROOM). The sim's trip is a
    constant CODEC_S, so a second chunk comes late only where the slack is negative; the GPU's trips
    jitter. Streams and steps are averaged over the last three quarters of the arrivals, the first
    quarter filling the worker."""
    end = t0 + duration_s
    s = serve(w, Poisson(rate, t0, end, rng), t0, end)
    done = s.done
    ttfa = np.array([heard(r) - r["sent"] for r in done])
    later = np.array([heard(r) - r["sent"] for r in done if r["sent"] >= t0 + duration_s / 2])
    late = np.array([r["late"] for r in done])
    wait = np.array([r["admitted"] - r["sent"] for r in done])
    frames = np.array([r["first_rows"] // FRAME for r in done])
    high = np.array([r["high"] for r in done if "high" in r])
    slack = np.array([r["second_slack"] for r in done if "second_slack" in r])
    promised = np.array([r["trip"] for r in done if "second_slack" in r])
    steady = [
        (dt, n)
        for (start, dt, _), n in zip(s.steps, s.served, strict=True)
        if t0 + duration_s / 4 <= start < end
    ]
    dts = np.array([dt for dt, _ in steady])
    rows = np.array([rows for (start, _, rows) in s.steps if t0 + duration_s / 4 <= start < end])
    streams = np.array([n for _, n in steady])
    return {
        "rate": rate,
        "requests": len(done),
        "ttfa_p50_ms": ms(np.percentile(ttfa, 50)),
        "ttfa_p95_ms": ms(np.percentile(ttfa, 95)),
        "ttfa_p99_ms": ms(np.percentile(ttfa, 99)),
        "ttfa_max_ms": ms(ttfa.max()),
        "ttfa_p50_ms_second_half": ms(np.percentile(later, 50)) if len(later) else None,
        "wait_p99_ms": ms(np.percentile(wait, 99)),
        "on_time_share": round(float((late <= 0.0).mean()), 4),
        "worst_late_ms": ms(late.max()),
        "second_slack_min_ms": ms(slack.min()) if len(slack) else None,
        "second_slack_p1_ms": ms(np.percentile(slack, 1)) if len(slack) else None,
        "second_under_delivery_share": round(float((slack < promised).mean()), 4) if len(slack) else None,
        "second_lane_trip_share": round(float((promised < DELIVERY_S).mean()), 3) if len(slack) else None,
        "first_frames": {f: round(float((frames == f).mean()), 3) for f in (1, 2, 3)},
        "first_period_high_p50_ms": ms(np.median(high)) if len(high) else None,
        "one_frame_period_ms": ms(one_frame_s(w.first_margin, w.delivery_s)),
        "streams_mean": round(float((streams * dts).sum() / dts.sum()), 1),
        "sitting_out_mean": round(float(((streams - rows) * dts).sum() / dts.sum()), 1),
        "row_period_mean_ms": ms(dts.mean()),
        "row_period_p95_ms": ms(np.percentile(dts, 95)),
        "x_realtime": round(len(done) * w.tokens / ROWS_PER_S / (s.t_end - t0), 1),
        "admitted_max": s.admitted_max,
        "capacity_min": round(min(s.caps), 1),
        "capacity_p50": round(float(np.median(s.caps)), 1),
        "cost_fit": [round(x * 1e6, 2) for x in w.clock.cost.coefficients() or ()],
        **(w.codec.figures(t0, end) if w.codec is not None else {}),
        "t_end": s.t_end,
    }


def ms(x: float) -> float:
    return round(1000 * float(x), 1)


def step(w: Worker, run: dict, t: float) -> float:
    """One step at `t` of the `run`ning requests (the streams ahead sitting it out), measured into the
    clock. → its seconds."""
    clock, period, prompt_len = w.clock, 1 / ROWS_PER_S, w.prompt_len
    ids = list(run)
    leads = [
        (r["sent_audio"] - (t - r["first"]))
        if r["first"] is not None and r["gen"] >= LEADS[-1]
        else -math.inf
        for r in (run[c] for c in ids)
    ]
    prompts = sum(run[c]["prompt"] for c in ids)
    out = set(w.sit.choose(leads, prompts)) if w.sit is not None else set()
    if w.first_audio is not None:
        w.first_audio.tick()
    if w.first_audio is not None and any(not run[c].get("switched") for c in ids):
        context = [0 if run[c]["prompt"] else prompt_len + run[c]["gen"] for c in ids]
        groups = w.gpu.groups(prompts)
        out |= set(w.first_audio.choose(leads, context, prompts, groups, prompts * prompt_len, out, w.cap))
    rows = [c for i, c in enumerate(ids) if i not in out]
    ctx = np.array([prompt_len + run[c]["gen"] for c in rows if not run[c]["prompt"]], dtype=float)
    dt = w.gpu.step_s(ctx, prompts, w.rng)
    w.rows = len(rows)
    t += dt
    cost = (len(rows) - prompts + prompts * prompt_len, int(ctx.sum()), prompts, w.gpu.groups(prompts))
    clock.record(len(rows), dt, now=t, streams=len(ids), cost=cost)
    for c in rows:
        r = run[c]
        r["prompt"] = False
        r["gen"] += 1
        n = r["gen"]
        if r["first"] is None and n % FRAME == 0:
            high = w.first_period_high(FRAME)
            if n == FRAME:
                r["high"] = high
            trip = w.trip_s()
            fits = lead_fits(FRAME, n * period, high, w.first_margin, latency_s=trip)
            if fits or n >= LEADS[-1] or n >= w.tokens:
                r["first"], r["sent_audio"], r["first_rows"], r["trip"] = t + CODEC_S, n * period, n, trip
                if w.codec is not None:  # every frame so far, decoded whole
                    w.codec.add(r, t, 0.0, 0.0, kind=(n, 0), first=True)
        elif r["first"] is not None and n % FRAME == 0:
            before, r["sent_audio"] = r["sent_audio"], n * period  # a frame's chunk
            if w.codec is not None:  # its slack: the audio before it less what played since the first left
                slack = before - (t - (r["first"] - CODEC_S))
                # a tail window: the newest frame after up to a regular window's rows of context
                kind = REGULAR_KIND if r.get("switched") else (min(n, REGULAR_ROWS), FRAME)
                w.codec.add(r, t, slack, before, kind=kind, second=n == r["first_rows"] + FRAME)
            if n == r["first_rows"] + FRAME:
                # the first chunk's audio left when the second is made: what a second chunk's trip
                # may take beyond the first's (lead_fits's promise: the trip the worker allowed it)
                r["second_slack"] = r["first_rows"] * period - (t - (r["first"] - CODEC_S))
        if r["first"] is not None and n % FRAME == 0 and not r.get("switched"):
            # progressive tail windows until the audio in hand (by the engine's clock, from when the
            # first chunk left) outlasts the wait for the next regular window at the pessimistic
            # pace or the step budget, whichever is slower (windows.py: `switches`)
            ahead, wait = r["sent_audio"] - (t - r["first"] + CODEC_S), REGULAR_WAIT
            pace, margin = clock.rows_time_high(wait) / wait, max(MARGIN, w.first_margin)
            r["switched"] = switch_fits(wait, ahead, pace, clock.budget, margin, DELIVERY_S)
    return dt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="384,400,416,480")
    ap.add_argument(
        "--rate",
        default="",
        help="open-loop Poisson arrivals at these rates (req/s, e.g. 20,40,80), not clients",
    )
    ap.add_argument(
        "--tokens", type=int, default=None, help="rows a request generates (1024; 360 with --rate)"
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--h200", action="store_true", help="the curved GPU fitted to the H200 load runs (H200)")
    ap.add_argument(
        "--h200-rate",
        action="store_true",
        help="the H200's step as its fit reads Poisson arrivals of short requests (H200_RATE, linear in rows)",
    )
    ap.add_argument(
        "--h200-poisson",
        action="store_true",
        help="H200_RATE with the step the H200 served at 80 req/s (H200_POISSON: the load it settled at)",
    )
    ap.add_argument("--calibrate", action="store_true", help="the fit starts from the startup steps")
    ap.add_argument("--forward", action="store_true", help="startup steps timed as the H200's (H200_FORWARD)")
    ap.add_argument(
        "--batched",
        action="store_true",
        help="the H200 with batched prefill graphs (H200_BATCHED, 1 + 8 prompts a step); policies beside: "
        "each prompt charged what the GPU's own prompts cost",
    )
    ap.add_argument("--ramp", type=float, default=8.0, help="seconds the clients start over (0: a burst)")
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds each level's requests come (20; 12 with --rate)"
    )
    ap.add_argument("--before", default="", help="levels the worker serves first, e.g. 64,256")
    ap.add_argument(
        "--first-audio-sit-out",
        action="store_true",
        help="beside each policy: streams ahead sit out while first chunks wait (FirstAudioSitOut)",
    )
    ap.add_argument(
        "--first-quantile",
        default="",
        help=f"policies besides: the first-chunk decision at these span quantiles (e.g. 0.8,0.9; "
        f"the engine's {SPAN_QUANTILE})",
    )
    ap.add_argument(
        "--first-margin",
        default="",
        help=f"policies besides: the first-chunk decision at these margins (e.g. 1.0; the engine's {MARGIN})",
    )
    ap.add_argument(
        "--lead-borrow",
        action="store_true",
        help="policies besides: a step's prompts take what the playing streams spare past the budget",
    )
    ap.add_argument(
        "--codec",
        action="store_true",
        help="the codec worker's passes between the steps and the listeners (Codec), not a constant trip",
    )
    ap.add_argument(
        "--codec-compile-tails",
        action="store_true",
        help="with --codec: beside each policy, a full window's tails decoded as regular windows (compiled): "
        "the server's default (--codec-compile-tails); without it the policies model uncompiled tails",
    )
    ap.add_argument(
        "--codec-part-ms",
        type=float,
        default=None,
        help=f"with --codec: each further replay of a small codec graph (Codec.part_ms, {Codec.part_ms})",
    )
    ap.add_argument(
        "--codec-first-lane",
        action="store_true",
        help="with --codec: beside each policy, first chunks arriving during a pass decoded at once in the "
        "first lane (Codec.lane 1, the server's --codec-first-lane)",
    )
    ap.add_argument(
        "--second-lane-delivery-ms",
        default="",
        help="with --codec: beside each policy, first and second chunks in the first lane (Codec.lane 2) "
        f"and the first-chunk decision allowing these ms for a second chunk's trip (the engine's "
        f"{1000 * DELIVERY_S:g}), e.g. 12,15",
    )
    ap.add_argument(
        "--lane-room",
        type=float,
        default=LANE_ROOM,
        help="every policy with --second-lane-delivery-ms: that trip only while the streams are at most "
        f"this share of the capacity, as the server's --codec-first-lane-room ({LANE_ROOM:g})",
    )
    ap.add_argument(
        "--trust-startup-steps",
        action="store_true",
        help="beside each policy: the startup steps count as measured (StepClock's trust_startup)",
    )
    ap.add_argument(
        "--max-prefills",
        type=int,
        default=0,
        help="every policy: a step starts at most this many prompts, as the server's --max-prefills "
        "with batched prefill graphs of that many (0: the simulated GPU's own: 10 with --h200-rate or "
        "--h200-poisson, a step's first prompt, its joiner and a batched graph of 8; 9 with --batched; 4 "
        "otherwise)",
    )
    ap.add_argument(
        "--lead-borrow-max",
        type=float,
        default=BORROW_MAX,
        help="every policy with --lead-borrow: a step takes at most this many budgets, as the server's "
        "--lead-borrow-max",
    )
    ap.add_argument(
        "--prompts-while-first",
        default="",
        help="policies besides: at most this many prompts a step while a first chunk waits (e.g. 1,2)",
    )
    args = ap.parse_args(argv)
    try:  # the server's bounds
        GpuWorkerSettings(lead_borrow_max=args.lead_borrow_max).check()
        CodecSettings(first_lane_room=args.lane_room).check()
    except ValueError as e:
        ap.error(str(e))
    poisson = bool(args.rate)
    tokens = args.tokens or (360 if poisson else 1024)
    # the simulated GPU: the first of these flags given, else GPU()
    gpus = [
        ("h200_poisson", H200_POISSON),
        ("h200_rate", H200_RATE),
        ("batched", H200_BATCHED),
        ("h200", H200),
    ]
    rows = []
    common = dict(
        gpu=next((g for flag, g in gpus if getattr(args, flag)), None),
        calibrate=args.calibrate or args.forward,
        startup=H200_FORWARD if args.forward else None,
        duration_s=args.duration or (12.0 if poisson else 20.0),
        prompts_a_step=args.max_prefills
        or (10 if args.h200_rate or args.h200_poisson else 9 if args.batched else 4),
        tokens=tokens,
        codec=args.codec,
        codec_part_ms=args.codec_part_ms,
        lead_borrow_max=args.lead_borrow_max,
        lane_room=args.lane_room,
    )
    if poisson:  # the engine's policy on a fresh worker, as `voxpipe bench ttfa --rate` serves
        policies = [("life", dict(life=True, **common))]
        levels, run = [float(x) for x in args.rate.split(",")], simulate_poisson
    else:
        common.update(ramp_s=args.ramp, before=tuple(int(x) for x in args.before.split(",") if x))
        policies = [("pace", dict(life=False, **common)), ("life", dict(life=True, **common))]
        if args.batched:
            policies.append(("life, the GPU's prompt costs", dict(life=True, gpu_charge=True, **common)))
        levels, run = [int(x) for x in args.clients.split(",")], simulate
    levers = [(f"first quantile {q}", dict(first_quantile=float(q))) for q in split(args.first_quantile)]
    levers += [(f"first margin {m}", dict(first_margin=float(m))) for m in split(args.first_margin)]
    levers += [
        (f"<= {k} prompts while first", dict(prompts_while_first=int(k)))
        for k in split(args.prompts_while_first)
    ]
    levers += [("lead borrow", dict(lead_borrow=True))] if args.lead_borrow else []
    weighed = [("life", dict(life=True, **common))]
    weighed += [(f"life, {lever}", dict(life=True, **kw, **common)) for lever, kw in levers]
    policies += weighed[1:]
    if args.first_audio_sit_out:
        policies += [(f"{name}, first-audio sit-out", dict(kw, first_audio=True)) for name, kw in weighed]
    if args.trust_startup_steps:
        policies += [(f"{name}, trusted startup steps", dict(kw, trust_startup=True)) for name, kw in weighed]
    if args.codec_first_lane:
        policies += [(f"{name}, first lane", dict(kw, codec_lane=1)) for name, kw in weighed]
    policies += [
        (
            f"{name}, first lane with second chunks, delivery {d} ms",
            dict(kw, codec_lane=2, delivery_s=float(d) / 1000),
        )
        for d in split(args.second_lane_delivery_ms)
        for name, kw in weighed
    ]
    if args.codec_compile_tails:
        policies += [
            (f"{name}, compiled tails", dict(kw, compiled_tails=True)) for name, kw in list(policies)
        ]
    for name, kw in policies:
        for n in levels:
            rows.append({"policy": name, **worst([run(n, seed=s, **kw) for s in range(args.seeds)])})
            print(json.dumps(rows[-1]))
    if args.out:
        what = "worst of the seeds per policy and load" + (
            " (first chunks' frames: their mean)" if poisson else ""
        )
        with open(args.out, "w") as f:
            json.dump({"what": what, "rows": rows}, f, indent=1)


def split(values: str) -> list[str]:
    return [x for x in values.split(",") if x]


def worst(runs: list[dict]) -> dict:
    """Each figure at its worst over `runs` (the least share on time, throughput and second chunks'
    slack, the most of the others), and the mean share of first chunks of each size."""
    row = {}
    for k, v in runs[0].items():
        if k == "t_end":
            continue
        if k in ("on_time_share", "x_realtime", "second_slack_min_ms", "second_slack_p1_ms"):
            row[k] = min((r[k] for r in runs if r[k] is not None), default=None)
        elif isinstance(v, dict):
            row[k] = {f: round(float(np.mean([r[k][f] for r in runs])), 3) for f in v}
        elif v is None or isinstance(v, (int, float, list)):
            row[k] = max((r[k] for r in runs), key=lambda x: (x is not None, x))
    row["on_time_share"] = row.pop("on_time_share")
    return row


if __name__ == "__main__":
    main()
