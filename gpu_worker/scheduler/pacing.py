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
  period; each step taken as much slower than the fit as the steps served lately are (`slowness`),
  and slower still past the rows measured (`measured_rows`), so that where the fit extrapolates
  the capacity stays below what the GPU keeps. Before that: the largest batch whose measured (or
  extrapolated) interval fits the row period with some headroom, and at least the recent load
  scaled by the budget over its recent interval (`paced_capacity`);
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
from collections.abc import Callable, Iterable

import numpy as np

# np.quantile (`rows_time_high`) imports numpy.ma at its first call, which comes only under a
# load that varies the batch: 50-80 ms inside a step of the first busy second on the H100.
import numpy.ma  # noqa: F401  (imported here, at startup)

from common.config import GpuWorkerSettings
from gpu_worker.scheduler.step_cost import COST_STEPS, Lives, StepCost

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
# The steps served against the fit (`slowness`): its ratio counts once this many of the last
# ~PACE_STEPS steps since the engine was last idle were measured against a fit.
SLOW_MIN_STEPS = 25
# `--trust-startup-steps`: what the steps served take over the forward pass the startup steps timed
# (sampling, the host's work, the codec beside them), at least, where the capacity reaches past the
# batches the steps served have measured: on the H200 at 352 streams the whole step takes ~1.3 times
# its forward pass. The steps served lately speak for the startup batch in proportion to their rows,
# wholly once they average this share of its rows (a light load's steps, which the fit has taken in,
# measure a slowness near 1 whatever the largest batches cost).
STARTUP_SLOWNESS, STARTUP_NEAR = 1.3, 0.5


def _bucket(batch: int) -> int:
    """Quarter-octave bucket of a batch size: 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 23, …"""
    if batch <= 8:
        return batch
    return round(2 ** (round(math.log2(batch) * 4) / 4))


def _span_high(dts: np.ndarray, rows: int) -> float:
    """The SPAN_QUANTILE of the times of every `rows` consecutive steps of `dts` (in order), or the
    latest such span if slower (a slowdown now)."""
    ends = np.cumsum(dts)
    spans = ends[rows - 1 :] - np.concatenate([[0.0], ends[:-rows]])
    return max(float(np.quantile(spans, SPAN_QUANTILE)), float(spans[-1]))


class StepClock:
    def __init__(
        self,
        rows_per_second: float,
        max_batch: int,
        headroom: float = GpuWorkerSettings().realtime_headroom,
        capacity_headroom: float = GpuWorkerSettings().capacity_headroom,
        trust_startup: bool = False,
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
        # The rows of the last PACE_STEPS steps measured into the fit; then (step number, rows) of
        # those before, each larger than every later one: the first is the largest batch among the
        # last COST_STEPS but PACE_STEPS (`largest_fitted`)
        self._fitting: deque[int] = deque()
        self._fitted: deque[tuple[int, int]] = deque()
        self._fitted_n = 0
        # Averages over the last ~PACE_STEPS steps since the engine was last idle that started no
        # prompt, measured against a fit: their interval, and what the fit said of them (`slowness`).
        self._slow_n, self._slow_dt, self._slow_fit, self._slow_rows = 0, 0.0, 0.0, 0.0
        # `trust_startup`: the startup steps' largest batch (`seed`) counts as measured rows
        # (`measured_rows`), the steps up to STARTUP_SLOWNESS times the fit while it sets them and
        # the steps served are smaller (`capacity`, `_startup_slowness`).
        self.trust_startup = trust_startup
        self._seeded_rows = 0
        # Steps of more than PROBE_MIN rows measured into the fit since the last COST_STEPS steps
        # held none, and the step number of the latest (`_seed_counts`)
        self._heavy_n, self._heavy_at = 0, 0
        # Seconds a step may take over the next steps whatever the steps before took (`expect`)
        self._expected = 0.0
        # `tick`'s costs of the last steps launched, the latest last
        self._launched: deque[tuple[int, int, int] | None] = deque(maxlen=3)

    @property
    def budget(self) -> float:
        """Seconds a step may take while its streams stay real time: `headroom` of the row period."""
        return self.headroom * self.period

    def tick(self, batch: int, streams: int = 0, cost: tuple[int, ...] | None = None) -> None:
        """Call once per launched step with its batch size (0 when the engine had nothing to run)
        and the streams it served (its rows and those sitting it out, see `SitOut`; default batch);
        `cost`, for `StepCost`: the tokens it computes (decode rows and prompt tokens), the context
        its decode rows attend over, its prompts and (if given; else a group each) the groups they
        ran in.

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
            self._pace_n = self._slow_n = 0
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
        cost: tuple[int, ...] | None = None,
    ) -> None:
        """One step of `batch` requests took `dt` seconds from the previous one, serving `streams`
        (default batch: more when some sat the step out); `cost`: that step's, as for `tick`."""
        if cost is not None:
            self._measured_against_fit(batch, cost, dt)
            tokens, context, prompts, *groups = cost
            self.cost.add(tokens, context, prompts, dt, *groups)
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

    def _measured_against_fit(self, batch: int, cost: tuple[int, ...], dt: float) -> None:
        """A step of `batch` rows that took `dt` seconds, about to go into the fit: into the largest
        batch the fit holds, and beside what the fit says of its `cost` (`slowness`)."""
        self._fitted_n += 1
        if batch > PROBE_MIN:
            self._heavy_n, self._heavy_at = self._heavy_n + 1, self._fitted_n
        elif self._fitted_n - self._heavy_at >= COST_STEPS:
            self._heavy_n = 0  # the heavy steps have left `largest_fitted`'s window
        self._fitting.append(batch)
        if len(self._fitting) > PACE_STEPS:
            rows = self._fitting.popleft()
            while self._fitted and self._fitted[-1][1] <= rows:
                self._fitted.pop()
            self._fitted.append((self._fitted_n - PACE_STEPS, rows))
            if self._fitted[0][0] <= self._fitted_n - COST_STEPS:
                self._fitted.popleft()
        predicted = self.cost.predict(*cost)
        if not cost[2] and predicted is not None and predicted > 0.0:
            self._slow_n += 1
            a = max(1.0 / self._slow_n, 1.0 / PACE_STEPS)
            self._slow_dt += a * (dt - self._slow_dt)
            self._slow_fit += a * (predicted - self._slow_fit)
            self._slow_rows += a * (batch - self._slow_rows)

    def largest_fitted(self) -> int:
        """The largest batch among the steps the fit holds (its last COST_STEPS) and the PACE_STEPS
        steps since have measured against it (`slowness`); 0 before any. A burst's batch grows faster
        than its steps tell the fit or the slowness what they cost: until they do, it is a batch the
        capacity extrapolates to (counted as they come, a simulated GPU a quarter of the H200's
        admits 142 streams where 122 keep real time)."""
        return self._fitted[0][1] if self._fitted else 0

    def measured_rows(self) -> float:
        """The rows the capacity takes as measured: the largest batch the fit holds and the steps since
        have measured (`largest_fitted`), or the rows of the steps `slowness` averages, if more
        (their slowness holds what the fit misses up to them). With `trust_startup`, the startup
        steps' largest batch too, while it speaks for the fit (`_seed_counts`)."""
        seeded = self._seeded_rows if self._seed_counts() else 0
        return max(float(self.largest_fitted()), self._slow_rows_measured(), float(seeded))

    def _seed_counts(self) -> bool:
        """With `trust_startup`: whether the startup steps' largest batch counts as measured rows:
        until the fit has taken COST_STEPS steps of more than PROBE_MIN rows, and again once
        COST_STEPS steps in a row have been light (the heavy ones have left the window that
        `largest_fitted` looks at: a burst after a long light spell is admitted as on a fresh
        worker). A light load's steps say nothing of a large batch, and the fit keeps the parts
        they do not tell apart from the fits before them (`StepCost`'s ridge), the startup steps'
        among them: a worker that served single streams for a while (`voxpipe bench ttfa` measures
        them before its load levels) still admits a burst up to what its startup steps measured,
        and keeps doing so while the burst's own steps are too few to speak for its largest
        batches."""
        return self.trust_startup and self._seeded_rows > 0 and self._heavy_n <= COST_STEPS

    def _slow_rows_measured(self) -> float:
        """The rows of the steps `slowness` averages, once it counts (else 0)."""
        return self._slow_rows if self._slow_n >= SLOW_MIN_STEPS else 0.0

    def _startup_slowness(self) -> float:
        """With `trust_startup`, the least slowness `capacity` takes while the startup steps' batch is
        the largest it takes as measured (they count, `_seed_counts`, and no batch the steps served
        measured is as large): STARTUP_SLOWNESS where the steps served lately are light, less in
        proportion as their rows come to STARTUP_NEAR of that batch, 1 from there on (their own
        slowness then speaks for it). Continuous, so that a steady load just below STARTUP_NEAR of
        the batch is not held to a capacity the same load a few rows larger is not: a step from the
        whole STARTUP_SLOWNESS to 1 at STARTUP_NEAR holds the simulated H200 at 90 req/s (~250
        streams) near its load, TTFA p95 363 ms against 154 ms with the fade, as without the trust."""
        if not self._seed_counts():
            return 1.0
        lately = self._slow_rows_measured()
        seeded = self._seeded_rows
        if seeded <= max(float(self.largest_fitted()), lately):
            return 1.0
        near = min(1.0, lately / (STARTUP_NEAR * seeded))
        return STARTUP_SLOWNESS - (STARTUP_SLOWNESS - 1.0) * near

    def slowness(self) -> float:
        """The steps' intervals over what the fit said of them, over the last ~PACE_STEPS since the
        engine was last idle that started no prompt (1.0 until SLOW_MIN_STEPS): above 1 where the
        streams served lately step slower than the fit of all its steps says, as the largest batches
        of a convex step time do, or every step beside startup steps that timed the forward pass
        alone (`seed`). Steps that start prompts are left out: the capacity is the streams' rows,
        and a burst's steps, each starting several prompts, are slower than a fit made of steps
        with one says by what the prompts cost (counted, they hold a fresh burst of 384 on the
        simulated H200 whose prompts beyond a step's first take a pass each to ~130 streams for a
        while, and its TTFA p99 grows from 2.2 s to 2.6 s)."""
        if self._slow_n < SLOW_MIN_STEPS or self._slow_fit <= 0.0:
            return 1.0
        return self._slow_dt / self._slow_fit

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
                self._seeded_rows = max(self._seeded_rows, rows)

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
        high = _span_high(np.fromiter(self._dts, float, len(self._dts)), rows)
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
        and prompt rate, each step as much slower than the fit as the steps served lately are
        (`slowness`), with a margin growing past the rows measured (`measured_rows`, at least
        PROBE_MIN: `StepCost.capacity`; with `trust_startup`, where the startup steps' batch sets
        those rows, up to STARTUP_SLOWNESS slower until the steps served lately average
        STARTUP_NEAR of its rows: `_startup_slowness`), within PROBE of the load served lately.
        Else the per-bucket model below, and never less than `paced_capacity`. The model alone dips
        below the load while every stream keeps time: a bucket above the load is reached in bursts
        of admissions, so its steps carry their prompts, it is measured slow, and the capacity is
        interpolated below it until the bucket goes stale (STALE_S): on the H200 at 352 streams the
        model alone gives a capacity of median 362 but p10 235, and requests wait in 11 % of the
        samples."""
        if lives is not None:
            # the startup steps timed the forward pass alone (`_startup_slowness`)
            seen, slow = max(self.measured_rows(), PROBE_MIN), max(self.slowness(), self._startup_slowness())
            life = self.cost.capacity(self.capacity_headroom * self.period, lives, seen, slow)
            if life is not None:
                # No further than PROBE beyond the load served lately: a fit made at a light load
                # says little of a much larger one (a step's time is flat at small batches), and
                # admission reaches it by measuring its way there; one `seed`ed with the largest
                # batches' steps has measured there, and a burst is admitted up to it at once (the
                # forward pass alone: the slowness and the margin past the rows measured hold the
                # capacity below what those steps say).
                reach = max(PROBE * self._pace_batch, self._pace_batch + PROBE_MIN)
                if self.cost.seeded:
                    reach = self.max_batch
                return float(min(self.max_batch, life, reach))
        return max(self._model_capacity(now), self.paced_capacity())

    def _model_capacity(self, now: float | None) -> float:
        budget = self.budget
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


# `lead_fits`'s margin for jitter in the steps (the first chunk's by default: `--first-chunk-margin`).
LEAD_MARGIN = 1.15


def lead_fits(
    gap_rows: int, lead_audio_s: float, row_period: float, margin: float = LEAD_MARGIN, latency_s: float = 0.0
) -> bool:
    """A lead window of `lead_audio_s` seconds keeps its listener fed if the next regular window,
    `gap_rows` steps later, arrives before the lead has played out (with `margin` for jitter in the
    steps, and `latency_s` for the next chunk's trip beyond the lead's). Measured on the H200, a
    single stream steps every ~3.4 ms: 21 rows take 71 ms against a one-frame lead's 85 ms, which a
    margin of 1.3 would refuse (TTFA 57 ms instead of 29 ms)."""
    return row_period > 0 and gap_rows * row_period * margin + latency_s <= lead_audio_s


def switch_fits(
    wait_rows: int, ahead_s: float, row_period: float, budget: float, margin: float = LEAD_MARGIN,
    latency_s: float = 0.0,
) -> bool:  # fmt: skip
    """Progressive mode's switch from tail windows to regular ones (gpu_worker/windows.py
    `switches`): `ahead_s` of audio sent and not yet played outlasts the `wait_rows` steps to the
    next regular window (`lead_fits` with `margin` and `latency_s`) at the pessimistic `row_period`
    or the step `budget`, whichever is slower; never where the pace is unknown (`row_period` 0)."""
    return row_period > 0 and lead_fits(wait_rows, ahead_s, max(row_period, budget), margin, latency_s)


# `step_allowance` (`--lead-borrow`): by default a step takes at most this many times its budget
# (`--lead-borrow-max`), however much audio its streams' listeners have in hand, so that the first
# audio of the streams not yet playing is not put off for long.
BORROW_MAX = GpuWorkerSettings().lead_borrow_max


def step_allowance(
    streams: Iterable[tuple[float, int]],
    rows_time_high: Callable[[int], float],
    margin: float = LEAD_MARGIN,
    latency_s: float = 0.0,
    row_s_min: float = 0.0,
) -> float:
    """The longest the next step may take with every playing stream's next chunk still reaching its
    listener in time (`lead_fits`' promise kept): for each stream (`streams`: the seconds of audio
    its listener has in hand, the rows until its next chunk leaves, this step's among them), its
    audio in hand, less the next chunk's trip (`latency_s`) and the other rows' time at the
    pessimistic rate (`rows_time_high`, at least `row_s_min` a row: the step budget, which a clock
    that has measured little may not know), all over `margin`; inf where no stream plays."""
    allow = math.inf
    for in_hand_s, rows in streams:
        others = max(rows_time_high(rows - 1), (rows - 1) * row_s_min) if rows > 1 else 0.0
        allow = min(allow, (in_hand_s - latency_s - margin * others) / margin)
    return allow


def step_allowances(
    streams: list[tuple[float, int]],
    rows_time_high: Callable[[int], float],
    margin: float,
    latency_s: float,
    budget: float,
) -> tuple[float, float]:
    """`step_allowance` of the same playing `streams` two ways: their other rows at least a step
    `budget` each (what `borrowable` lends on: a clock that has measured little may not know the
    pace), and at the clock's pessimistic pace alone (the pace first chunks are promised on: what
    `withheld` keeps of the budget)."""
    return (
        step_allowance(streams, rows_time_high, margin, latency_s, budget),
        step_allowance(streams, rows_time_high, margin, latency_s),
    )


def withheld(allow: float, budget: float) -> float:
    """Seconds of a step's `budget` that its prompts may not take where the streams playing allow the
    step `allow` seconds by `step_allowance`: a stream that went out with a first chunk of one frame,
    promised on the pace of the light steps before a burst came, spares less than a step budget
    until it is ahead; all of it where a stream is already short (a step then starts only its first
    prompt). Taken on the fit's word for the step (not as much slower as the steps served lately
    run: near capacity every young stream spares about the steps' own pace, and a cap below it
    would start fewer prompts a step than arrive); a step that runs slower leaves the stream less
    in hand, which the next steps' allowance sees."""
    return max(0.0, budget - allow)


def borrowable(allow: float, budget: float, slowness: float = 1.0, most: float = BORROW_MAX) -> float:
    """Seconds a step may take past its `budget` (`--lead-borrow`) where the streams playing allow
    it `allow` seconds by `step_allowance` (a step taken `slowness` times what the fit says): at
    most `most` budgets in all (`--lead-borrow-max`)."""
    return max(0.0, min(allow / max(1.0, slowness), most * budget) - budget)
