"""What a step costs by its parts (`StepCost`: a fixed part, per token, per token of context, per
prompt, per group of prompts run together), fitted over the steps served, and what the requests served are like over their lives
(`Lives`): from them `gpu_worker.scheduler.pacing.StepClock` gives the streams a worker keeps real
time, and the scheduler how many prompts a step may start beside its running streams."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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

# Past the largest batch among the steps the fit holds, a step is taken to cost this share of the
# fit more for each doubling of the rows beyond it (`capacity`'s `seen`). A step's time is convex in
# its rows (past ~100 rows the GEMMs are compute-bound, and the host's work and the codec beside the
# steps grow with the streams): a line through smaller batches understates a larger one. On the
# H200 a fit over steps of up to 256 rows puts the capacity at 483 streams, the steps of 352 rows of
# a burst that follows take ~1.1-1.15x what it says (0.46 doublings beyond: 0.3 a doubling), and the
# fit those steps make puts it at ~430 (the burst results of record, docs/performance.md).
# Doublings, not rows or multiples: the margin from a light load to a burst several times larger
# stays moderate (from 64 rows to 256, 1.6x), so that a burst well within what the GPU keeps is
# admitted at once.
EXTRAPOLATION = 0.3


# `StepCost`'s terms, and every subset of them, each fitted alone (nonnegative least squares by
# enumeration)
TERMS = 5
SUBSETS = [tuple(i for i in range(TERMS) if m >> i & 1) for m in range(1, 1 << TERMS)]


@dataclass(frozen=True)
class PromptRoom:
    """What a step leaves for prompts beside its decode rows (`StepCost.prompt_room`), in seconds:
    a prompt of n tokens that opens g more groups costs `prompt + token * n + group * g`; the
    prompts may also take what the step may run past its budget (`borrowed`: `--lead-borrow`), and
    may not take what the playing streams cannot spare of it (`withheld`)."""

    room: float
    prompt: float = 0.0
    token: float = 0.0
    group: float = 0.0
    borrowed: float = 0.0
    withheld: float = 0.0

    def cost(self, tokens: int, groups: int) -> float:
        return self.prompt + self.token * tokens + self.group * groups

    def expected(self, spent: float, waiting: bool, budget: float, slowness: float) -> float:
        """What the steps after this one may take (`StepClock.expect`) once it has started prompts
        of fitted cost `spent`, prompts still `waiting` or not: first audio promised meanwhile must
        not count on lighter steps. A step that may borrow, where prompts wait or it runs past its
        room, at its fitted time as much slower as the steps served lately run (`slowness`); else,
        while prompts wait, up to the budget (by the fit where it bounds the room); else as the
        steps go (0)."""
        if self.borrowed and (waiting or spent > self.room):
            return slowness * (budget - self.room + spent)
        if waiting:
            return budget if math.isinf(self.room) else min(budget, budget - self.room + spent)
        return 0.0


@dataclass(frozen=True)
class Lives:
    """What the requests a worker serves are like over their lives (`Engine.lives`)."""

    context: float  # tokens of context a running stream attends over, averaged over its time in a slot
    prompt_tokens: float  # a request's prompt
    rows: float  # rows a request generates: a slot takes a new prompt every `rows` steps


class StepCost:
    """A step's time as a + b x tokens + c x context + d x prompts + e x groups: a fixed part, a part
    per token it computes (a decode row, a prompt token: the weights' GEMMs), a part per thousand
    tokens of context that its decode rows attend over, a part per prompt (its attention plan, its
    output head) and a part per group of prompts that run through the weights together (a prefill
    lane, riding the decode pass or a pass of its own, or a batched prefill graph of several
    prompts: `GraphRunner.prompt_groups`). Fitted by least squares with nonnegative terms over the last ~COST_STEPS steps as they were
    served, the codec beside them included.

    What it is for: a stream's steps cost more as its context grows (at ~550 tokens attention is
    ~45 % of an H200 step at 384 rows), so a load measured while its streams are young takes longer
    steps later in their lives. Admission from the pace alone admits young streams that the same
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

    def __init__(self) -> None:
        self.n = 0
        k = TERMS
        self._xx = np.zeros((k, k))  # average of x x^T, x = (1, tokens, context / 1000, prompts, groups)
        self._xy = np.zeros(k)  # average of x dt
        self._yy = 0.0  # average of dt^2
        self._fit: tuple[float, ...] | None = None
        self._fit_at = 0  # self.n when last fitted
        self.seeded = False  # steps measured at startup among its own: it fits before COST_MIN_STEPS
        # `calibrate`'s differences, their moments weighted and held apart from the decaying ones
        self._cal_xx, self._cal_xy, self._cal_yy = np.zeros((k, k)), np.zeros(k), 0.0

    def calibrate(self, diffs: list[tuple[tuple[float, ...], float]]) -> None:
        """Differences between pairs of steps measured at startup, each ((more tokens, more
        thousands of tokens of context, more prompts[, more groups of prompts]), more seconds; a
        prompt each its own group where the groups are not given); they count beside the steps
        served at CALIBRATION_WEIGHT of those steps' averages, for good."""
        # More of a part never takes less time: a difference that says so (noise, something else
        # on the GPU then) or none (a failed timing) would hold the fit to it for good.
        diffs = [(dx, dy) for dx, dy in diffs if math.isfinite(dy) and dy > 0 and all(map(math.isfinite, dx))]
        if not diffs:
            return
        x = np.array([[0.0, *map(float, dx[:3]), float(dx[3] if len(dx) > 3 else dx[2])] for dx, _ in diffs])
        y = np.array([float(dy) for _, dy in diffs])
        w = CALIBRATION_WEIGHT / len(diffs)
        self._cal_xx, self._cal_xy, self._cal_yy = w * x.T @ x, w * x.T @ y, w * float(y @ y)
        self._fit = None  # fit again with them

    def seed(self, tokens: int, context: int, dt: float) -> None:
        """A whole step timed at startup, as a step served: the fit counts at once (the steps
        served soon outweigh it, each weighing 1 / n)."""
        self.add(tokens, context, 0, dt)
        self.seeded, self._fit = True, None

    def add(self, tokens: int, context: int, prompts: int, dt: float, groups: int | None = None) -> None:
        """One step's time `dt` and what it computed (prompt tokens among the `tokens`; its prompts
        in `groups` that ran together, default each its own)."""
        groups = prompts if groups is None else groups
        x = np.array([1.0, float(tokens), context / 1000.0, float(prompts), float(groups)])
        self.n += 1
        a = max(1.0 / self.n, 1.0 / COST_STEPS)
        self._xx += a * (np.outer(x, x) - self._xx)
        self._xy += a * (x * dt - self._xy)
        self._yy += a * (dt * dt - self._yy)

    def coefficients(self) -> tuple[float, ...] | None:
        """(a s, b s per token, c s per thousand tokens of context, d s per prompt, e s per group of
        prompts), or None before
        COST_MIN_STEPS steps (but `seed`ed): of the fits on every subset of the terms whose
        coefficients are all nonnegative, the one with the least squared error. Fitted again every
        REFIT_STEPS steps."""
        if self.n < COST_MIN_STEPS and not self.seeded:
            return None
        if self._fit is None or self.n - self._fit_at >= REFIT_STEPS:
            prior = np.array(self._fit or (0.0,) * TERMS)
            best, least = (0.0,) * TERMS, math.inf
            all_xx, all_xy = self._xx + self._cal_xx, self._xy + self._cal_xy
            all_yy = self._yy + self._cal_yy
            for terms in SUBSETS:
                ix = np.array(terms)
                xx, xy = all_xx[np.ix_(ix, ix)], all_xy[ix]
                ridge = RIDGE * np.diag(np.diag(xx))
                try:
                    beta = np.linalg.solve(xx + ridge, xy + ridge @ prior[ix])
                except np.linalg.LinAlgError:
                    continue
                err = all_yy - 2.0 * beta @ xy + beta @ xx @ beta
                if (beta >= 0).all() and err < least:
                    full = np.zeros(TERMS)
                    full[ix] = beta
                    best, least = tuple(float(v) for v in full), err
            self._fit, self._fit_at = best, self.n
        return self._fit

    def predict(self, tokens: int, context: int, prompts: int, groups: int | None = None) -> float | None:
        """Seconds a step of `tokens`, `context`, `prompts` and `groups` (as `add` takes them) takes
        by the fit; None before it."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c, d, e = fit
        groups = prompts if groups is None else groups
        return a + b * tokens + c * context / 1000.0 + d * prompts + e * groups

    def prompt_room(self, budget: float, rows: int, context: int) -> PromptRoom | None:
        """What a step of `rows` decode rows attending over `context` tokens leaves for prompts
        within `budget`, and what they cost, by the fit; None before it."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c, d, e = fit
        return PromptRoom(budget - (a + b * rows + c * context / 1000.0), d, b, e)

    def capacity(
        self, budget: float, lives: Lives, seen: float = math.inf, slow: float = 1.0
    ) -> float | None:
        """Streams whose step, all of them in it at `lives.context` tokens of context each and a
        new prompt every `lives.rows` steps in each slot, takes `budget` seconds (at least 1): each
        step `slow` times what the fit says (the steps served lately against the fit, at least 1),
        and a step of more than `seen` rows (those measured) EXTRAPOLATION of the fit more for each
        doubling of the rows beyond them. None before the fit counts or where it says a stream costs
        nothing."""
        fit = self.coefficients()
        if fit is None:
            return None
        a, b, c, d, e = fit
        # a steady load's prompts come one at a time: each a group of its own
        per_stream = b + c * lives.context / 1000.0 + (d + e + b * lives.prompt_tokens) / max(lives.rows, 1.0)
        if per_stream <= 0.0:
            return None
        room = budget / max(slow, 1.0)
        n = (room - a) / per_stream
        if n > seen and EXTRAPOLATION > 0.0:  # the step's time past `seen` grows faster: bisect
            lo, hi = seen, n
            while hi - lo > 0.01:
                mid = 0.5 * (lo + hi)
                over = (a + per_stream * mid) * (1.0 + EXTRAPOLATION * math.log2(mid / seen)) > room
                lo, hi = (lo, mid) if over else (mid, hi)
            n = lo
        return max(1.0, n)
