"""Sit-out: streams well ahead of their listeners leave steps out while steps run over budget
(`SitOut`), and, with `--first-audio-sit-out`, while a stream's first frames wait for steps at the
pace that sends them alone (`FirstAudioSitOut`)."""

from __future__ import annotations

import math
from collections.abc import Callable

from common.config import GpuWorkerSettings
from gpu_worker.scheduler.pacing import StepClock

# The interval the share sitting out aims at, as a share of the budget: a little below it, so that
# the paced capacity (streams served x budget / interval) stays above the streams served and
# admission goes on while streams ahead can make room.
SIT_OUT_TARGET = 0.97
# How fast the share sitting out follows the step interval: per step, this times the interval's
# excess over the target (a step 10 % over adds half a percent of the streams).
SIT_OUT_GAIN = 0.05
SIT_OUT_MAX = 0.5  # of the streams a step serves (its rows and those sitting out)


def out_to_bucket(sizes: list[int], rows: int, out: int, most: int) -> int | None:
    """Streams to leave out of `rows` decode rows so that the rows left fill the decode bucket at
    or below `rows - out` (`sizes` ascending), if that is at most `most`; else None."""
    below = [b for b in sizes if b <= rows - out]
    return rows - below[-1] if below and rows - below[-1] <= most else None


class SitOut:
    """Streams well ahead of their listeners sit out steps while steps run slower than the budget.

    A step's time grows with its rows, the more so the longer their contexts; a stream's listener
    needs a row only every row period. When the step interval exceeds the target (SIT_OUT_TARGET x
    the budget, headroom x row period: long contexts together, say), the streams with the most
    audio in hand beyond `spare_s` skip the step, so it is shorter for everyone else: the requests
    just started, whose listeners have little audio yet, and those waiting for admission, which the
    paced capacity (counting the streams sitting out as served) keeps admitting. The share sitting
    out is integral control on the interval's excess over the target, so it settles where the
    interval meets it, and falls to none once steps keep it without help. (Where fewer rows do not
    make shorter steps, a host-bound loop say, it climbs to what the streams ahead allow and spends
    their lead for nothing; nothing guards against that.) A stream sits out only while it has
    `spare_s` in hand, so its listener never waits: the headroom each stream gains in the steps it
    is in is spent, not its timeliness. With decode graphs (batch buckets), the rows left are
    rounded to a bucket's size, since a step costs its bucket's padding anyway.

    On the H200 (fp8 weights and cache, MPS, closed-loop 1024-token streams, spare 1 s), sitting out
    takes TTFA at 416 streams from p50 886 / p99 1837 ms without it to 198 / 1369 ms, at 384 from
    p99 1017 to 664 ms, with 100 % and 99.9 % (99.6 % without) of requests on time."""

    def __init__(
        self,
        clock: StepClock,
        sizes: list[int] | None = None,
        spare_s: float = GpuWorkerSettings().sit_out_lead_s,
    ) -> None:
        if not spare_s > 0:
            raise ValueError(f"a stream sits out steps only with audio in hand: spare_s > 0, got {spare_s}")
        self.clock = clock
        self.sizes = sorted(sizes) if sizes else []
        self.spare_s = spare_s
        self.share = 0.0

    def choose(self, leads: list[float], prompts: int = 0) -> list[int]:
        """`leads[i]`: seconds of audio row i's listener has in hand (-inf where it may not sit
        out: a prompt, a stream before its regular windows); `prompts` of the rows are prompts,
        which a decode graph's bucket does not count → the rows to leave out of the next step."""
        clock, n = self.clock, len(leads)
        interval, target = clock.row_period(), SIT_OUT_TARGET * clock.budget
        ahead = [i for i, lead in enumerate(leads) if lead >= self.spare_s]
        if interval <= 0.0 or n == 0:
            self.share = 0.0
            return []
        # Never wind up beyond what the streams ahead allow: the share must fall at once when
        # the steps come back within the budget.
        most = min(SIT_OUT_MAX, len(ahead) / n)
        self.share = min(most, max(0.0, self.share + SIT_OUT_GAIN * (interval / target - 1.0)))
        most_out = min(len(ahead), math.floor(SIT_OUT_MAX * n))
        out = min(most_out, round(self.share * n))
        if out and self.sizes:
            # Decode rows left: the bucket at or below, else the next one up (the padding is paid
            # anyway), within what the streams ahead and SIT_OUT_MAX allow.
            dec = n - prompts
            down = out_to_bucket(self.sizes, dec, out, most_out)
            out = down if down is not None else dec - next((b for b in self.sizes if b >= dec - out), dec)
        if out <= 0:
            return []
        ahead.sort(key=lambda i: leads[i], reverse=True)
        return ahead[:out]


class FirstAudioSitOut:
    """First-audio sit-out (`--first-audio-sit-out`): while a running stream waits for its first
    chunk or still sends tail windows (progressive first chunks), streams with `spare_s` of audio in
    hand sit out so that each step, by the clock's fitted cost (`StepCost`, times its `slowness`),
    comes to at most `bound()` / `margin`: `bound()` is the pace per row at which a first frame goes
    out alone now (`lead_fits` on `rows_time_high`, the high quantile of a frame's step spans, hence
    the margin for the steps' spread): `AudioWindows.one_frame_row_s`, which follows the trip the
    first-chunk decision allows the second chunk at the load of the moment (or a constant). Those
    with the most audio in hand sit out first, no more than SIT_OUT_MAX of the streams a step serves,
    the rows left rounded down to a decode graph's bucket (its padding is paid anyway), as `SitOut`
    leaves them; beside `SitOut`, whose streams it counts as out. It changes no token, as `SitOut`
    does not.

    Sitting out moves a step's rows to later steps, it does not take them away: under a steady
    load the steps' mean interval stays what the load makes it, and only its spread shrinks (the
    steps with prompts give rows to those without). So the policy acts only while the mean
    interval (over ~100 steps) is within `bound()`, and while the streams are within `room` of the
    capacity (a stream sitting out lives longer, so more streams run at once, and near the capacity
    they would hold new requests at admission).

    Simulated on the H200's step as its fit reads Poisson arrivals of 360-row requests
    (bench/admission_sim.py H200_RATE, `voxpipe bench sim --rate 80,90 --h200-rate --forward
    --seeds 5 --first-audio-sit-out`, worst of the seeds, every request on time either way): at 80
    req/s first chunks of one frame 94 % of them against 66 %, TTFA p50 / p95 / p99 59 / 108 / 115
    ms against 64 / 119 / 125, ~52 streams sitting out; at 90 req/s 78 % against 26 %, but 64 / 137 /
    146 ms against 116 / 131 / 138 (its p95 and p99 worse), ~108 out; at 100-110 req/s (mean
    interval past the bound) it acts only while the load grows, and at 110 its streams coming back
    take p99 from 173 to 300 ms; nothing changes at 20-40 req/s. With `--first-chunk-margin 1.0`
    (a bound 15 % higher) it holds 80 and 90 req/s to p95 67 and 72 ms (three seeds; both runs are
    results of record: docs/operations.md, First-audio sit-out)."""

    def __init__(
        self,
        clock: StepClock,
        sizes: list[int] | None,
        spare_s: float,
        bound: float | Callable[[], float],
        margin: float = 1.1,
        room: float = 0.85,
    ) -> None:
        if not spare_s > 0:
            raise ValueError(f"a stream sits out steps only with audio in hand: spare_s > 0, got {spare_s}")
        self.clock, self.sizes, self.spare_s, self.margin = clock, sorted(sizes or []), spare_s, margin
        self.room = room
        self.bound: Callable[[], float] = bound if callable(bound) else (lambda: bound)
        self.period = 0.0  # the step interval over the last ~100 steps (`tick`)

    def tick(self) -> None:
        """Every step: follow the steps' interval (~100 steps' average)."""
        self.period += (0.01 if self.period else 1.0) * (self.clock.row_period() - self.period)

    def choose(
        self,
        leads: list[float],
        context: list[int],
        prompts: int,
        groups: int,
        prompt_tokens: int,
        out: set[int],
        capacity: float,
    ) -> list[int]:
        """`leads[i]`: seconds of audio row i's listener has in hand (-inf where it may not sit out);
        `context[i]`: the tokens it attends over (0 for a prompt); `prompts` of the rows are
        prompts of `prompt_tokens` tokens in all, in `groups`; `out`: the rows sitting out already;
        `capacity`: the streams the worker reports it keeps real time → the rows to leave out
        besides (none once the streams pass `room` of the capacity)."""
        cost = self.clock.cost
        fit = cost.coefficients()
        bound = self.bound()
        if fit is None or len(leads) > self.room * capacity or self.period > bound:
            return []
        _, b, c, _, _ = fit
        slow, target = self.clock.slowness(), bound / self.margin
        rows = [i for i in range(len(leads)) if i not in out]
        tokens = len(rows) - prompts + prompt_tokens
        step = slow * cost.predict(tokens, sum(context[i] for i in rows), prompts, groups)
        if step <= target:
            return []
        ahead = sorted((i for i in rows if leads[i] >= self.spare_s), key=lambda i: leads[i], reverse=True)
        most = min(len(ahead), math.floor(SIT_OUT_MAX * len(leads)) - len(out))
        chosen = []
        for i in ahead[: max(0, most)]:
            if step <= target:
                break
            chosen.append(i)
            step -= slow * (b + c * context[i] / 1000.0)
        # decode rows left, rounded down to a bucket within `most`
        down = out_to_bucket(self.sizes, len(rows) - prompts, len(chosen), most)
        if chosen and down is not None:
            chosen = ahead[:down]
        return chosen
