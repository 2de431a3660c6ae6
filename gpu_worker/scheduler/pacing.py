"""How fast the engine steps, measured while it serves: real-time capacity and the first-chunk choice,
from the step clock (`StepClock`) and the step cost (`StepCost`).

A step produces one row for every running request (but those sitting it out, `SitOut`), so the
time between consecutive steps is the time each stream waits for its next row. A stream stays real
time while that interval is below the program's row period (1 / rows per audio second: 12.19 ms
at 82.03 rows a second). `StepClock` keeps an exponential average of the interval per batch-size bucket
(quarter octaves), which gives

- `capacity(lives=)`: the streams this worker keeps real time, which the gateway admits to it.
  Once `StepCost` has fitted a step's time (fixed, per token, per token of context, per prompt):
  the load whose step, at the context its streams attend over averaged over their lives and their
  prompts at the rate they come, takes `capacity_headroom` (`--capacity-headroom`) of the row
  period. Before that: the largest batch whose measured (or extrapolated) interval fits the row
  period with some headroom, and at least the recent load scaled by the budget over its recent
  interval (`paced_capacity`);
- `row_period()`: the recent interval at the current load, and `row_period_high()` a pessimistic
  one (plus twice the recent spread);
- `rows_time_high(n)`: how long the next n steps may take, from the last steps' own n-step spans
  (a high percentile of them), and no less than the scheduler expects while prompts wait
  (`expect`), which decides whether a request's first audio can come from a short lead window and
  when it may switch to regular windows (see `lead_fits`).

Intervals are wall-clock and include everything that shares the GPU and the host loop (the codec,
prefill steps, message handling): what a stream actually experiences.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from common.config import GpuWorkerSettings

_MIN_SAMPLES = 8  # steps measured in a bucket before it counts
# `rows_time_high`: the steps it looks back on (~1 s under load), the spans it needs among them
# before it trusts them, and which of their span times it takes.
RECENT_STEPS, MIN_SPANS, SPAN_QUANTILE = 96, 16, 0.95
# A bucket not measured for this long stops counting. Admission keeps batches below the capacity,
# so a large batch once measured slow (a burst of prefills, say) would otherwise cap the capacity
# for good (on the H200 one such moment can hold a server to ~140 streams for minutes while its
# steady step times allow ~350). Forgetting it lets admission probe that batch size again.
STALE_S = 20.0
# A bucket measured within the budget counts this long: under a steady load the batch stays in one
# or two buckets, and the slope to extrapolate from needs a smaller batch measured earlier.
FIT_STALE_S = 120.0
# The weight of a new step in its bucket's average, once the bucket has that many: ~100 steps, about
# a second under load. Capacity is what a worker sustains: a burst of arrivals (one prefill in each
# of the next few dozen steps) slows those steps, not the next seconds'. An average over ~20 steps
# lets such bursts push the bucket in use past the budget, so that admission holds requests back
# while the streams running stay on time (on the H200 at 256 streams: capacity median 301,
# minimum 221).
BUCKET_ALPHA = 0.01
# How far beyond the largest batch measured within budget the capacity may be extrapolated: a factor,
# or a number of streams where that is more.
PROBE, PROBE_MIN = 1.5, 64
# The pace at the load being served, averaged over ~PACE_STEPS steps (about a second under load), any
# bucket: `capacity` never says less than that pace allows in proportion (see `paced_capacity`).
PACE_STEPS = 100
# ... and no further than this share beyond the load served: the proportion is exact for a step time
# linear in the batch, and only near it for the steps that are not (a graph bucket's padding, costs
# that grow with context), so admission reaches a larger batch by measuring its way there.
PACE_REACH = 0.25


# `StepCost`: the steps it averages over (~20 s under load: a ramp's loads of several sizes and
# contexts, or a steady load's, which the ridge below keeps from undoing what a ramp told), and
# those it needs before it counts.
COST_STEPS, COST_MIN_STEPS = 2000, 200
# ... how often it fits again (~0.5 s under load), and how firmly a fit holds to the one before where
# the steps do not tell its parts apart (a share of each term's own scale; see `StepCost`).
REFIT_STEPS, RIDGE = 50, 1e-3
# The weight of the differences measured at startup (`StepCost.calibrate`) beside the steps served,
# as a share of those steps' averages: enough to tell the parts apart where the steps do not.
CALIBRATION_WEIGHT = 0.1


@dataclass(frozen=True)
class Lives:
    """What the requests a worker serves are like over their lives (`Engine.lives`)."""

    context: float  # tokens of context a running stream attends over, averaged over its time in a slot
    prompt_tokens: float  # a request's prompt
    rows: float  # rows a request generates: a slot takes a new prompt every `rows` steps


class StepCost:
    """A step's time as a + b x tokens + c x context + d x prompts: a fixed part, a part per token it
    computes (a decode row, a prompt token: the weights' GEMMs), a part per thousand tokens of
    context that its decode rows attend over, and a part per prompt (its own graph, its planning).
    Fitted by least squares with nonnegative terms over the last ~COST_STEPS steps as they were
    served, the codec beside them included.

    What it is for: a stream's steps cost more as its context grows (at ~550 tokens attention is
    ~45 % of an H200 step at 384 rows), so a load measured while its streams are young takes longer
    steps later in their lives. Admission from the pace alone admitted young streams that the same
    GPU cannot keep real time once they are old (bench/admission_sim.py). The prompt term keeps the
    context's part apart from the prompts': the young streams of a ramp come with prompts, and
    without it the fit charges their cost to the tokens and takes the context's part for none (in
    the simulation, 5.8 instead of 18 us per thousand tokens at 2.5 ms a prompt; on the H200, none).

    A steady load does not tell the parts apart (the same tokens every step: a fixed part or a
    part per token fit it equally): each fit is held towards the one before by a small ridge
    (RIDGE of each term's own scale), so what the steps do not say, the fit of the steps before keeps.
    Without the ridge, 400 s of a steady load on the simulated GPU (bench/admission_sim.py) move the
    fixed part from 3.0 to 5.6 ms and the part per token from 10 to 0.4 us, and the capacity between
    378 and 512.

    Nor does a ramp tell them apart, though its steps grow in rows and in context at once: a step's
    time is not linear in its rows (the GEMMs read the weights whatever the rows, and only past a
    hundred or so rows do the rows cost compute), and a fit over a ramp's steps charges that curve
    to the context, which grows like the square of the rows. On the H200, a fresh server's first
    ramp to 400 streams alone fits 30 us per thousand tokens of context and 2.2 us a token (steady:
    11 and 10), and puts the capacity below the 400 streams running for a few seconds. `calibrate`
    adds what the engine measured at startup, steps that differ in one thing only: the same rows at
    two contexts, two batches at one context, a step with and without a prompt. A difference has no
    fixed part and holds every other part equal. The startup steps lack what the steps served carry
    besides the forward pass (sampling, the host's work, the codec beside them under MPS, which
    slows every part a little), so their differences understate each part somewhat; held at
    CALIBRATION_WEIGHT of the steps' averages, they keep the parts apart where the steps served do
    not tell them apart, and the steps served set the rest."""

    TERMS = 4
    # every subset of the terms, each fitted alone (nonnegative least squares by enumeration)
    SUBSETS = [tuple(i for i in range(4) if m >> i & 1) for m in range(1, 1 << 4)]

    def __init__(self) -> None:
        self.n = 0
        k = self.TERMS
        self._xx = np.zeros((k, k))  # average of x x^T, x = (1, tokens, context / 1000, prompts)
        self._xy = np.zeros(k)  # average of x dt
        self._yy = 0.0  # average of dt^2
        self._fit: tuple[float, ...] | None = None
        self._fit_at = 0  # self.n when last fitted
        self.seeded = False  # steps measured at startup among its own: it fits before COST_MIN_STEPS
        # `calibrate`'s differences, their moments weighted and held apart from the decaying ones
        self._cal_xx, self._cal_xy, self._cal_yy = np.zeros((k, k)), np.zeros(k), 0.0

    def calibrate(self, diffs: list[tuple[tuple[float, float, float], float]]) -> None:
        """Differences between pairs of steps measured at startup, each ((more tokens, more
        thousands of tokens of context, more prompts), more seconds); they count beside the steps
        served at CALIBRATION_WEIGHT of those steps' averages, for good."""
        # More of a part never takes less time: a difference that says so (noise, something else
        # on the GPU then) or none (a failed timing) would hold the fit to it for good.
        diffs = [(dx, dy) for dx, dy in diffs if math.isfinite(dy) and dy > 0 and all(map(math.isfinite, dx))]
        if not diffs:
            return
        x = np.array([[0.0, *map(float, dx)] for dx, _ in diffs])
        y = np.array([float(dy) for _, dy in diffs])
        w = CALIBRATION_WEIGHT / len(diffs)
        self._cal_xx, self._cal_xy, self._cal_yy = w * x.T @ x, w * x.T @ y, w * float(y @ y)
        self._fit = None  # fit again with them

    def seed(self, tokens: int, context: int, dt: float) -> None:
        """A whole step timed at startup, as a step served: the fit counts at once (the steps
        served soon outweigh it, each weighing 1 / n)."""
        self.add(tokens, context, 0, dt)
        self.seeded, self._fit = True, None

    def add(self, tokens: int, context: int, prompts: int, dt: float) -> None:
        """One step's time `dt` and what it computed (prompt tokens among the `tokens`)."""
        x = np.array([1.0, float(tokens), context / 1000.0, float(prompts)])
        self.n += 1
        a = max(1.0 / self.n, 1.0 / COST_STEPS)
        self._xx += a * (np.outer(x, x) - self._xx)
        self._xy += a * (x * dt - self._xy)
        self._yy += a * (dt * dt - self._yy)

    def coefficients(self) -> tuple[float, ...] | None:
        """(a s, b s per token, c s per thousand tokens of context, d s per prompt), or None before
        COST_MIN_STEPS steps (but `seed`ed): of the fits on every subset of the terms whose
        coefficients are all nonnegative, the one with the least squared error. Fitted again every
        REFIT_STEPS steps."""
        if self.n < COST_MIN_STEPS and not self.seeded:
            return None
        if self._fit is None or self.n - self._fit_at >= REFIT_STEPS:
            prior = np.array(self._fit or (0.0,) * self.TERMS)
            best, least = (0.0,) * self.TERMS, math.inf
            all_xx, all_xy = self._xx + self._cal_xx, self._xy + self._cal_xy
            all_yy = self._yy + self._cal_yy
            for terms in self.SUBSETS:
                ix = np.array(terms)
                xx, xy = all_xx[np.ix_(ix, ix)], all_xy[ix]
                ridge = RIDGE * np.diag(np.diag(xx))
                try:
                    beta = np.linalg.solve(xx + ridge, xy + ridge @ prior[ix])
                except np.linalg.LinAlgError:
                    continue
                err = all_yy - 2.0 * beta @ xy + beta @ xx @ beta
                if (beta >= 0).all() and err < least:
                    full = np.zeros(self.TERMS)
                    full[ix] = beta
                    best, least = tuple(float(v) for v in full), err
            self._fit, self._fit_at = best, self.n
        return self._fit

    def prompt_room(self, budget: float, rows: int, context: int) -> tuple[float, float, float] | None:
        """(seconds a step of `rows` decode rows attending over `context` tokens leaves for prompts
        within `budget`, seconds a prompt costs, seconds per prompt token) by the fit; None before it."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c, d = fit
        return budget - (a + b * rows + c * context / 1000.0), d, b

    def capacity(self, budget: float, lives: Lives) -> float | None:
        """Streams whose step, all of them in it at `lives.context` tokens of context each and a
        new prompt every `lives.rows` steps in each slot, takes `budget` seconds (at least 1); None
        before the fit counts or where it says a stream costs nothing."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c, d = fit
        per_stream = b + c * lives.context / 1000.0 + (d + b * lives.prompt_tokens) / max(lives.rows, 1.0)
        if per_stream <= 0.0:
            return None
        return max(1.0, (budget - a) / per_stream)


def _bucket(batch: int) -> int:
    """Quarter-octave bucket of a batch size: 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 23, …"""
    if batch <= 8:
        return batch
    return round(2 ** (round(math.log2(batch) * 4) / 4))


class StepClock:
    def __init__(
        self,
        rows_per_second: float,
        max_batch: int,
        headroom: float = GpuWorkerSettings().realtime_headroom,
        capacity_headroom: float = GpuWorkerSettings().capacity_headroom,
    ) -> None:
        self.period = 1.0 / rows_per_second  # seconds per row a real-time stream can afford
        self.max_batch = max_batch
        self.headroom = headroom
        self.capacity_headroom = capacity_headroom
        self._ema: dict[int, float] = {}
        self._size: dict[int, float] = {}  # bucket → average batch of its steps (the x of its point)
        self._count: dict[int, int] = {}
        self._seen: dict[int, float] = {}  # bucket → perf_counter of its last measurement
        self._recent = 0.0  # EMA of the interval at whatever the batch was lately
        self._spread = 0.0  # EMA of how far an interval lands from that average
        self._last: float | None = None
        self._dts: deque[float] = deque(maxlen=RECENT_STEPS)  # the latest intervals, any batch
        self._span_high: dict[int, float] = {}  # rows → rows_time_high, until the next record
        # Averages over the last ~PACE_STEPS steps since the engine was last idle: streams served
        # (rows, and streams sitting a step out), interval.
        self._pace_n, self._pace_batch, self._pace_dt = 0, 0.0, 0.0
        self._pace_rows = 0.0  # rows per step over the same steps (streams sitting out excluded)
        self.cost = StepCost()
        # Seconds a step may take over the next steps whatever the steps before took (`expect`)
        self._expected = 0.0
        # `tick`'s costs of the last steps launched, the latest last
        self._launched: deque[tuple[int, int, int] | None] = deque(maxlen=3)

    def tick(self, batch: int, streams: int = 0, cost: tuple[int, int, int] | None = None) -> None:
        """Call once per launched step with its batch size (0 when the engine had nothing to run)
        and the streams it served (its rows and those sitting it out, see `SitOut`; default batch);
        `cost`, for `StepCost`: the tokens it computes (decode rows and prompt tokens), the context
        its decode rows attend over, and its prompts.

        The engine launches a step, then waits for the one before: the interval between one call
        and the next is the time of the step launched at the call before the first, two calls
        before the one that measures it, which is what `StepCost` pairs it with (the step sizes
        and their intervals vary together only over many steps, so the other averages take it as
        it comes)."""
        now = time.perf_counter()
        last, self._last = self._last, (now if batch else None)
        if not batch:  # idle: the steps before say nothing of the next ones' pace
            self._dts.clear()
            self._span_high.clear()
            self._pace_n = 0
            self._launched.clear()
            return
        self._launched.append(cost)
        if last is not None:  # else the engine was idle in between: not a step
            lagged = self._launched[0] if len(self._launched) == self._launched.maxlen else None
            self.record(batch, now - last, streams=streams, cost=lagged)

    def record(
        self,
        batch: int,
        dt: float,
        now: float | None = None,
        streams: int = 0,
        cost: tuple[int, int, int] | None = None,
    ) -> None:
        """One step of `batch` requests took `dt` seconds from the previous one, serving `streams`
        (default batch: more when some sat the step out); `cost`: that step's, as for `tick`."""
        if cost is not None:
            self.cost.add(*cost, dt)
        key = _bucket(batch)
        now = time.perf_counter() if now is None else now
        self._dts.append(dt)
        self._span_high.clear()
        if now - self._seen.get(key, now) > STALE_S:
            self._count[key] = 0  # stale: start this bucket's average afresh
        self._seen[key] = now
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        # Average the first samples plainly, then track drift (graphs warming up, context growth).
        alpha = max(1.0 / (n + 1), BUCKET_ALPHA)
        self._ema[key] = dt if n == 0 else self._ema[key] + alpha * (dt - self._ema[key])
        self._size[key] = batch if n == 0 else self._size[key] + alpha * (batch - self._size[key])
        self._pace_n += 1
        a = max(1.0 / self._pace_n, 1.0 / PACE_STEPS)
        self._pace_batch += a * (max(batch, streams) - self._pace_batch)
        self._pace_rows += a * (batch - self._pace_rows)
        self._pace_dt += a * (dt - self._pace_dt)
        if self._recent == 0.0:
            self._recent = dt
        else:
            self._spread += 0.2 * (abs(dt - self._recent) - self._spread)
            self._recent += 0.2 * (dt - self._recent)

    def row_period(self) -> float:
        """Seconds per row at the current load (0.0 before any step was measured)."""
        return self._recent

    def row_period_high(self) -> float:
        """A pessimistic seconds per row at the current load: the average plus twice the spread.
        Steps under load are uneven (a prefill, a codec pass beside the step): a promise to a
        listener (a lead window, the switch to regular windows) is made on slow steps, not average
        ones."""
        return self._recent + 2.0 * self._spread

    def seed(self, steps: dict[tuple[int, int], float], now: float | None = None) -> None:
        """Steps timed at startup ((rows, context of each) → seconds: the largest batches at a long
        context) as measured ones, in their buckets and in `StepCost`: a fresh worker's capacity
        is what its GPU keeps real time, not its largest batch, until the steps served take over."""
        now = time.perf_counter() if now is None else now
        for (rows, context), dt in steps.items():
            if dt > 0 and math.isfinite(dt):
                key = _bucket(rows)
                self._ema[key], self._size[key], self._count[key], self._seen[key] = (
                    dt,
                    rows,
                    _MIN_SAMPLES,
                    now,
                )
                self.cost.seed(rows, rows * (context - 1), dt)

    def expect(self, step_s: float) -> None:
        """The next steps may each take `step_s` seconds, whatever the last ones took (0: as they
        went): the scheduler says so while prompts wait, so that first audio is not promised on
        lighter steps than those that start them (`rows_time_high`)."""
        self._expected = step_s

    def rows_time_high(self, rows: int) -> float:
        """Seconds the next `rows` steps may take: `_rows_time_high`, and no less than `expect` says."""
        return max(self._rows_time_high(rows), rows * self._expected)

    def _rows_time_high(self, rows: int) -> float:
        """Seconds the next `rows` steps may take: the SPAN_QUANTILE of the times of every `rows`
        consecutive steps among the last RECENT_STEPS, or the latest such span if slower (the load
        just grew). A slow step (a prefill, a codec pass beside it) counts once in the spans it
        falls in, as it will in the next one; `row_period_high` charges it to every row. Until
        enough steps are measured: rows * row_period_high()."""
        if rows <= 0:
            return 0.0
        if rows in self._span_high:
            return self._span_high[rows]
        if len(self._dts) < rows + MIN_SPANS:
            return rows * self.row_period_high()
        ends = np.cumsum(np.fromiter(self._dts, float, len(self._dts)))
        spans = ends[rows - 1 :] - np.concatenate([[0.0], ends[:-rows]])
        high = max(float(np.quantile(spans, SPAN_QUANTILE)), float(spans[-1]))  # the latest: a slowdown now
        self._span_high[rows] = high
        return high

    def paced_capacity(self) -> float:
        """The streams served lately scaled by the budget over their average interval, at most
        PACE_REACH beyond them (0 until PACE_STEPS steps since the engine was last idle). Where a
        step's time is a fixed part plus a part per stream, this proportion understates the batch
        that reaches the budget, and admitting up to it brings the pace to the budget from below;
        where it is not linear (a graph bucket's padding, costs that grow with context) it can
        overshoot the budget by a few percent until the next steps say so. Every step counts,
        prompts and codec passes beside it included, at the rate they come now."""
        if self._pace_n < PACE_STEPS or self._pace_dt <= 0.0:
            return 0.0
        paced = self._pace_batch * self.headroom * self.period / self._pace_dt
        # Streams sitting out (`SitOut`) spend their lead: never more streams than the rows made
        # keep at real time, the headroom spent, or admission outgrows what the GPU sustains once
        # no stream is left ahead. In a simulation (3 ms + 21 us a row, 480 closed-loop clients)
        # counting them as served without this bound admits up to 449 streams, past the 437 whose
        # steps take a row period, and 9 % of requests fall behind; with it, at most 418 and none.
        real_time = self._pace_rows * self.period / self._pace_dt
        return min(float(self.max_batch), paced, real_time, self._pace_batch * (1.0 + PACE_REACH))

    def capacity(self, now: float | None = None, lives: Lives | None = None) -> float:
        """Concurrent streams this worker can keep real time (max_batch until measured). Given
        `lives` (the requests it serves, over their lives) and once `StepCost` has its fit: the
        streams whose step takes `capacity_headroom` of a row period at their life-average context
        and prompt rate, within PROBE of the load served lately. Else the per-bucket model below,
        and never less than `paced_capacity`. The model alone dips below the load while every
        stream keeps time: a bucket above the load is reached in bursts of admissions, so its steps
        carry their prompts, it is measured slow, and the capacity is interpolated below it until
        the bucket goes stale (STALE_S): on the H200 at 352 streams the model alone gives a
        capacity of median 362 but p10 235, and requests wait in 11 % of the samples."""
        if lives is not None:
            life = self.cost.capacity(self.capacity_headroom * self.period, lives)
            if life is not None:
                # No further than PROBE beyond the load served lately: a fit made at a light load
                # says little of a much larger one (a step's time is flat at small batches), and
                # admission reaches it by measuring its way there; one `seed`ed with the largest
                # batches' steps has measured there, and a burst is admitted up to it at once.
                reach = max(PROBE * self._pace_batch, self._pace_batch + PROBE_MIN)
                if self.cost.seeded:
                    reach = self.max_batch
                return float(min(self.max_batch, life, reach))
        return max(self._model_capacity(now), self.paced_capacity())

    def _model_capacity(self, now: float | None) -> float:
        budget = self.headroom * self.period
        now = time.perf_counter() if now is None else now
        # (average batch, step time, bucket) of each bucket measured enough and lately
        points = sorted(
            (self._size[k], v, k)
            for k, v in self._ema.items()
            if self._count[k] >= _MIN_SAMPLES
            and now - self._seen[k] <= (FIT_STALE_S if v <= budget else STALE_S)
        )
        if not points:
            return float(self.max_batch)
        fitting = [i for i, (_, v, _) in enumerate(points) if v <= budget]
        if not fitting:
            # Even the smallest measured batch is too slow: scale it down proportionally.
            b, v, _ = points[0]
            return max(1.0, b * budget / v)
        i = fitting[-1]
        b1, v1, _ = points[i]  # the largest batch measured keeping time (its bucket's average)
        # Never below it: with the estimate below the streams already running, admission would hold
        # new requests back from a worker that serves them on time.
        if i + 1 < len(points):  # a larger measured batch is too slow: interpolate up to it
            b2, v2, _ = points[i + 1]
            slope = max((v2 - v1) / max(b2 - b1, 1e-9), 1e-9)
            return float(min(self.max_batch, max(b1, b1 + (budget - v1) / slope)))
        # Nothing measured too slow: at least in proportion to b1 (a step has a fixed part, so its
        # time grows slower than the batch); along the line from a batch measured at least a
        # quarter smaller, if any (decode time grows ~linearly; neighbouring buckets under a steady
        # load differ by noise, which swung a slope between them from flat to steep); and no
        # further than PROBE beyond b1, so admission finds a larger batch's time by measuring it.
        ahead = b1 * budget / max(v1, 1e-9)
        reach = max(PROBE * b1, b1 + PROBE_MIN)
        if len(points) == 1:  # no slope: in proportion, or probe onwards from a lightly loaded GPU
            return float(min(self.max_batch, max(ahead, reach) if v1 <= 0.5 * budget else ahead))
        b0, v0, _ = points[0]
        line = b1 + (budget - v1) * (b1 - b0) / (v1 - v0) if b1 - b0 >= 0.25 * b1 and v1 > v0 else 0.0
        return float(min(self.max_batch, max(b1, ahead, min(line, reach))))


def lead_fits(
    gap_rows: int, lead_audio_s: float, row_period: float, margin: float = 1.15, latency_s: float = 0.0
) -> bool:
    """A lead window of `lead_audio_s` seconds keeps its listener fed if the next regular window,
    `gap_rows` steps later, arrives before the lead has played out (with `margin` for jitter in the
    steps, and `latency_s` for the next chunk's trip beyond the lead's). Measured on the H200, a
    single stream steps every ~3.4 ms: 21 rows take 71 ms against a one-frame lead's 85 ms, which a
    margin of 1.3 would refuse (TTFA 57 ms instead of 29 ms)."""
    return row_period > 0 and gap_rows * row_period * margin + latency_s <= lead_audio_s
