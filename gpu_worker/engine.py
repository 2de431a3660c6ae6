"""The gpu_worker's engine: continuous batching over a paged KV cache, one step ahead of the host.

Three parts, one job each: the `Scheduler` (gpu_worker/scheduler/) decides which requests run
when; the `ModelRunner` (gpu_worker/runner/) runs a step on the device; the engine turns what a
step produced into request state, audio windows (`AudioWindows`) and finished requests. Each
`step()`:
  1. schedule: admit waiting prompts while slots and KV pages last, and leave out the streams well
     ahead of their listeners while steps run over the budget (they resume where they were);
  2. run: launch the step on the device (forward, sampling, one device→host copy of the results);
  3. process: only then wait for the *previous* step's results and turn them into audio chunks
     and finished requests (one `DetokBatch`).
So the host's bookkeeping for step n overlaps the GPU's work on step n+1. The price is one step of
lag in noticing a stop token: a request that stopped is already in the step launched after it,
whose token is dropped.

Launched at once, step n+1 is scheduled early in step n's time on the device, and a prompt that
arrives later in it waits for step n+2: from arrival to its first row takes two and a half steps
on average. With `--late-launch on` the worker keeps taking messages until step n is about to end
(`hold_s`: its start, the steps' measured device time, less the host's time to schedule and launch
and a margin) and only then schedules step n+1, so most prompts start in the next step; if step n has ended by
then, its results are processed (and sent) first, and step n+1 launched after them. The launch time
is that of a step that starts prompts while prompts wait (laying a prompt out and planning its
attention take longer than a decode step's launch), else a decode step's. The margin follows the
device's idle time before each step: it grows when the GPU waited for the launch, and shrinks
slowly while it did not.

With `--prompt-lane on` a prompt need not wait for the step in flight at all: `lane_step` (the
worker calls it while it takes messages) starts waiting prompts in the free prompt lanes
(`--prompt-lanes`, one by default), each its first step on a stream of its own beside the step in
flight (gpu_worker/runner/prompt_lane.py), and once a lane's row is on the host turns it into the
request's first audio like any step's; the request runs in the steps from its second row. What
keeps the lanes, and the steps, off each other's slots and KV pages: `lane_step`.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable

import torch

from common.config import GpuWorkerSettings
from common.messages import Appends, DetokBatch, DetokChunk, FinishReason, Prompt
from gpu_worker.appends import HeldAppends
from gpu_worker.runner.kv_cache import PageAllocator
from gpu_worker.runner.model_runner import InFlight, ModelRunner
from gpu_worker.runner.slots import SlotState
from gpu_worker.scheduler.pacing import StepClock
from gpu_worker.scheduler.request import Request
from gpu_worker.scheduler.scheduler import Scheduler, step_clock
from gpu_worker.scheduler.sit_out import SitOut
from gpu_worker.scheduler.step_cost import Lives
from gpu_worker.windows import DELIVERY_S, LANE_DELIVERY_S, LANE_ROOM, AudioWindows
from programs.base import LMProgram, TokenKind

__all__ = ["Engine", "GpuWorkerSettings"]

_STOP, _AUDIO = int(TokenKind.STOP), int(TokenKind.AUDIO)
# Late launch: the margin kept before the step on the device ends (seconds: at first, at least, and
# at most as a share of the step), and the device idle before a step that counts as waiting for the
# launch (on the H200 a step launched early still leaves the device ~0.05-0.1 ms idle on average).
LATE_MARGIN_S, LATE_MARGIN_MIN_S, LATE_MARGIN_MAX_SHARE = 0.002, 0.0005, 0.5
LATE_IDLE_S = 0.0005
# On a GPU, a step whose wall time (schedule, launch, wait for the previous step, process) passes
# this is recorded with its parts (`slow_step`): no step of a healthy server comes near it (a full
# batch of 512 on the H200 takes ~15 ms), and one past it can make streams late. (A CPU's steps
# vary with the machine's load: none is recorded there unless a test sets `slow_step_s`.)
SLOW_STEP_S = 0.04


class GcTimer:
    """Seconds the cyclic garbage collector has run in this process since the timer began (a
    `gc.callbacks` hook times each collection): one a process, `gc_timer()`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began = 0.0
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._began


_GC_TIMER: GcTimer | None = None


def gc_timer() -> GcTimer:
    global _GC_TIMER
    if _GC_TIMER is None:
        _GC_TIMER = GcTimer()
    return _GC_TIMER


class Engine:
    def __init__(
        self,
        program: LMProgram,
        limits: GpuWorkerSettings,
        progress=None,
        codec_lane: bool = False,
        lane_room: float = LANE_ROOM,
    ) -> None:
        """`codec_lane`: the codec decodes a request's first two chunks in its first lane
        (`--codec-first-lane` on a GPU): a first chunk goes out after one frame with less allowed for
        the second's trip (windows.LANE_DELIVERY_S) while the streams are at most `lane_room` of the
        capacity (`--codec-first-lane-room`)."""
        limits = limits.filled(program.device.type, program.spec["max_tokens"])
        self.program = program
        self.limits = limits
        self.device = program.device
        self.runner = ModelRunner(program, limits, progress)
        clock = step_clock(program, limits)
        self.windows = AudioWindows(
            program, limits.first_chunk, clock, first_margin=limits.first_chunk_margin,
            second_delivery_s=LANE_DELIVERY_S if codec_lane else DELIVERY_S, lane_room=lane_room,
        )  # fmt: skip
        self.scheduler = Scheduler(
            program, limits, self.runner.num_pages, self.runner.slots, clock, self.windows,
            getattr(self.runner.forward_runner, "sizes", None), real_time=self.device.type == "cuda",
        )  # fmt: skip
        self._inflight: InFlight | None = None
        self._lanes: list[InFlight] = []  # prompts' first steps in the prompt lanes, in flight
        # Events of lane or step work that `fail_all` drops unfinished while it puts the slots and
        # pages that work writes back in the pool: the main stream and each lane's stream wait on
        # them before admission writes, until they have passed.
        self._lane_fences: list[torch.cuda.Event] = []
        # What the host does while it waits for a step on the device (the worker's: prompts that
        # arrive meanwhile and ended lanes take their turn, `lane_step`); None: it blocks. The step
        # waited for is `_waiting` meanwhile: it still writes what its requests hold or gave back.
        self.on_wait: Callable[[], None] | None = None
        self._waiting: InFlight | None = None
        self.lane_prompts = 0  # prompts started in a lane, all time
        self._appends = HeldAppends()  # written at the next step
        self._written: list[Request] = []  # whose slots appends wrote since the last launch
        self.step_count = 0
        self.tokens_total = 0  # sampled rows consumed, all requests
        # Where a step's wall time goes (exponential averages, seconds): the host's own work (admit,
        # layout, launch, consume), and waiting for the GPU to finish the previous step. A host
        # time near the step interval with little wait means the host, not the GPU, sets the pace.
        self.host_s = self.wait_s = 0.0
        self._waited = 0.0
        self._collected_only = False  # the last `step` collected a step and launched none
        self._carried = (0.0, 0.0)  # a collect-only step's host time and wait, for the launch after it
        # Late launch (GPU only): when the step in flight began on the device, as the host knows
        # it (perf_counter), the host's time to schedule and launch a step (exponential averages:
        # a step that starts prompts, and one that does not), and the margin kept before the step's end.
        self.late = limits.late_launch == "on" and self.device.type == "cuda"
        self._began = 0.0
        self.launch_s = self.launch_prompt_s = 0.0
        self.late_margin_s = LATE_MARGIN_S
        self.hold_avg_s = 0.0  # the worker's hold before each step (exponential average)
        # The last step past SLOW_STEP_S, in ms by part (None until one), and how many there were.
        self.slow_step: dict[str, float] | None = None
        self.slow_steps = 0
        self.slow_step_s = SLOW_STEP_S if self.device.type == "cuda" else float("inf")
        self._gc = gc_timer()
        self._parts = (0.0, 0.0, 0, 0)  # this step's schedule and launch (seconds), batch, prompts
        # The last call of `step`: its wall time, its parts as `_parts`, and its wait for the device
        # (seconds); the tap's step events report it (gpu_worker/stages.py).
        self.last_step: tuple[float, tuple[float, float, int, int], float] = (0.0, self._parts, 0.0)
        if self.runner.has_graphs:
            self.runner.capture_sampling(progress)
            self.scheduler.calibrate(self.runner.forward_runner, progress)

    # --- the parts' state, as the worker, tests and benches read it ----------------------------
    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    @property
    def slots(self) -> SlotState:
        return self.runner.slots

    @property
    def allocator(self) -> PageAllocator:
        return self.scheduler.allocator

    @property
    def clock(self) -> StepClock:
        return self.scheduler.clock

    @property
    def sit_out(self) -> SitOut | None:
        return self.scheduler.sit_out

    @property
    def running(self) -> dict[str, Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def outputs(self) -> dict[str, tuple[list, FinishReason]] | None:
        """rid → (generated rows, reason) of each finished request, when set to a dict."""
        return self.scheduler.outputs

    @outputs.setter
    def outputs(self, value: dict[str, tuple[list, FinishReason]] | None) -> None:
        self.scheduler.outputs = value

    @property
    def num_active(self) -> int:
        return self.scheduler.num_active

    def lives(self) -> Lives | None:
        return self.scheduler.lives()

    # --- requests in and out -------------------------------------------------------------------
    def add(self, prompt: Prompt) -> None:
        self.scheduler.add(prompt)

    def reject(self, rid: str, message: str) -> None:
        """End a request that could not start with an explicit 400."""
        self.scheduler.reject(rid, message)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def append(self, msg: Appends) -> None:
        """Appended text into its requests' state at the next step (gpu_worker/appends.py)."""
        self._appends.add(msg)

    def abort_all(self) -> None:
        """Stop every request this engine holds (their gateway is gone)."""
        self.scheduler.end_all(FinishReason.ABORT)

    def fail_all(self, message: str) -> None:
        """After a failed step: end every request with an explicit error and reclaim all state
        (every slot and KV page free again, also those the books had lost: `Scheduler.reset`)."""
        dropped = [s.ready for s in (self._inflight, *self._lanes) if s is not None and s.ready is not None]
        # Their work may still run on the device, and so may work queued by a launch that raised
        # before its handle was kept (a step's, or a lane's admission writes): all of it fenced.
        self._lane_fences += dropped + self.runner.queued()
        self._inflight, self._lanes, self._written = None, [], []
        self.scheduler.end_all(FinishReason.ERROR, message, 500)
        self.scheduler.reset()

    def credits(self) -> int:
        """Prompts this worker can start at once (`Scheduler.credits`)."""
        return self.scheduler.credits()

    def run_until_idle(self) -> list[DetokBatch]:
        """Step until every request has finished (offline use: tests, benchmarks)."""
        out = []
        while self.has_work():
            batch = self.step()
            if batch is not None:
                out.append(batch)
        return out

    def has_work(self) -> bool:
        s = self.scheduler
        # A request waiting for appended text is no work until its text comes (the worker blocks).
        runnable = any(not s.waits(r) for r in s.running.values())
        return bool(runnable or s.waiting or s.finished or self._inflight or self._lanes or self._appends)

    def metrics(self) -> dict[str, float]:
        s, r = self.scheduler, self.runner
        lives = s.lives()
        return {
            "kv_pages_used": s.allocator.num_used,
            "kv_pages_total": s.allocator.num_pages - 1,
            "decode_batch_size": s.last_batch_size,
            "streams_sitting_out": round(s.sitting_out, 1),
            "queue_depth": len(s.waiting),
            "active_streams": len(s.running),
            "generated_tokens_total": self.tokens_total,
            "steps_total": self.step_count,
            "stream_capacity": round(s.capacity(lives), 1),
            "life_context": round(lives.context if lives else 0.0, 1),
            **s.step_cost(),
            "row_period_ms": round(1000 * s.clock.row_period(), 3),
            "step_host_ms": round(1000 * self.host_s, 3),
            "step_wait_ms": round(1000 * self.wait_s, 3),
            "step_gpu_forward_ms": round(1000 * r.gpu_forward_s, 3),
            "step_gpu_ms": round(1000 * r.gpu_step_s, 3),
            "step_gpu_idle_ms": round(1000 * r.gpu_idle_s, 3),
            "step_launch_ms": round(1000 * self.launch_s, 3),
            "step_launch_prompt_ms": round(1000 * self.launch_prompt_s, 3),
            "late_margin_ms": round(1000 * self.late_margin_s, 3) if self.late else 0.0,
            "step_hold_ms": round(1000 * self.hold_avg_s, 3),
            "prompts_started_total": s.prompts_started,
            "steps_borrowing_total": s.steps_borrowing,
            "steps_withholding_total": s.steps_withholding,
            "prompts_in_lane_total": self.lane_prompts,
            "slow_steps_total": self.slow_steps,
            **{f"admission_stopped_by_{k}_total": v for k, v in s.admission_stops.items()},
        }

    def hold_s(self) -> float:
        """Seconds the worker may keep taking messages before it schedules the next step: with late
        launch, until the step in flight is due to end less the launch time (a prompt step's while
        prompts wait) and the margin, and not once it has ended (`step` then processes it before
        launching the next); else 0."""
        step = self._inflight
        if not self.late or step is None or step.ready is None:
            return 0.0
        launch = max(self.launch_s, self.launch_prompt_s) if self.scheduler.waiting else self.launch_s
        hold = self._began + self.runner.gpu_step_s - launch - self.late_margin_s - time.perf_counter()
        return hold if hold > 0.0 and not self._ended(step) else 0.0

    def held(self, seconds: float) -> None:
        """The worker held `seconds` before scheduling the next step (`hold_s`); not counted with
        no step in flight (after a collect-only step the launch holds for nothing)."""
        if self._inflight is not None:
            self.hold_avg_s += 0.05 * (seconds - self.hold_avg_s)

    def _follow_idle(self) -> None:
        """Late launch: widen the margin by what the device waited for the last launch, else
        narrow it slowly (within LATE_MARGIN_MIN_S and LATE_MARGIN_MAX_SHARE of a step)."""
        idle = self.runner.last_idle_s
        if idle is None:
            return
        if idle > LATE_IDLE_S:
            margin = 1.1 * self.late_margin_s + idle
        else:
            margin = 0.98 * self.late_margin_s
        cap = max(LATE_MARGIN_MIN_S, LATE_MARGIN_MAX_SHARE * self.runner.gpu_step_s)
        self.late_margin_s = min(cap, max(LATE_MARGIN_MIN_S, margin))

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> DetokBatch | None:
        """Launch the next step, then collect the previous one (with late launch, a step found
        ended is collected first and the next launched by the next call); what it produced, or
        None."""
        t0, cpu0, gc0 = time.perf_counter(), time.thread_time(), self._gc.seconds
        self._waited = 0.0
        self._collected_only = False
        self._parts = (0.0, 0.0, 0, 0)
        out = self._step()
        wall = time.perf_counter() - t0
        self.last_step = (wall, self._parts, self._waited)
        if wall > self.slow_step_s:
            self._slow(wall, time.thread_time() - cpu0, self._gc.seconds - gc0)
        if self.scheduler.last_batch_size:
            # A collect-only call and the launch after it are one step's host work and wait.
            host = time.perf_counter() - t0 - self._waited + self._carried[0]
            waited = self._waited + self._carried[1]
            if self._collected_only:
                self._carried = (host, waited)
                return out
            self._carried = (0.0, 0.0)
            self.host_s += 0.05 * (host - self.host_s)
            self.wait_s += 0.05 * (waited - self.wait_s)
        return out

    def _step(self) -> DetokBatch | None:
        if self.late and self._ended(self._inflight):
            # The step in flight ended before the next was launched: its frames go out first (the
            # launch would hold them for its host time, ~4 ms at batch 1); the next call launches.
            previous, self._inflight = self._inflight, None
            self._collected_only = True
            out = self._batch(self._process(previous))
            if not self.has_work():  # nothing to launch next: the device idles from here
                self.runner.idle()
            return out
        # 1. schedule: who runs this step (with the text appended since the last)
        t0 = time.perf_counter()
        # What a lane whose request ended while it runs gave back may go to this step's requests:
        # their admission writes, and the step's, follow that lane's work (and any dropped work's).
        self.runner.follow(self._fences())
        self._written += self._appends.write(self.scheduler)
        batch = self.scheduler.schedule(self.runner.max_prefills_per_step, self.runner.prompt_groups)
        # 2. run: launch it on the device
        previous, self._inflight = self._inflight, None
        if batch:
            # When it begins on the device, as the host can tell: its launch's start, unless the
            # step before it is still running then (`_process` dates it from that one's end).
            self._began = time.perf_counter()
            prompts = batch[0].n_ctx == 0  # new requests come first
            n_prompts = sum(r.n_ctx == 0 for r in batch) if prompts else 0
            self._inflight = self.runner.launch(batch)
            self._inflight.touched, self._written = self._written, []
            took = time.perf_counter() - t0
            self._parts = (self._began - t0, took - (self._began - t0), len(batch), n_prompts)
            if prompts:
                self.launch_prompt_s += 0.05 * (took - self.launch_prompt_s)
            else:
                self.launch_s += 0.05 * (took - self.launch_s)
        # 3. process: the previous step's results → request state, audio chunks, finished requests
        chunks = self._process(previous) if previous is not None else []
        if not batch:  # after `_process`, which dates the device's next idle from its step's end
            self.runner.idle()
        return self._batch(chunks)

    def step_parts(self) -> dict[str, float]:
        """Where the last call of `step` went (seconds): its `wall` time, `schedule` (admission,
        appends, the layout), `launch`, `wait` (for the previous step on the device, and the lanes'
        turns meanwhile) and `process`, the rest (its rows into windows and ends)."""
        wall, (schedule, launch, _, _), waited = self.last_step
        return {
            "wall": wall,
            "schedule": schedule,
            "launch": launch,
            "wait": waited,
            "process": max(0.0, wall - schedule - launch - waited),
        }

    def _slow(self, wall: float, cpu: float, gc_s: float) -> None:
        """Record a step past `slow_step_s` with where its time went (ms): `schedule` (admission,
        appends, the layout), `launch`, `wait` (for the previous step on the device, and the lanes'
        turns meanwhile) and `process` (its rows into windows and ends), with the batch it
        launched and the prompts in it (0 and 0: it only collected a step); also the host thread's
        CPU time in the step (`cpu`: far below the wall outside `wait`, the thread was held off
        the CPU or blocked) and the cyclic garbage collector's time (`gc`)."""
        _, _, batch, prompts = self._parts
        ms = self.step_parts() | {"cpu": cpu, "gc": gc_s}
        self.slow_steps += 1
        self.slow_step = {k: round(1000 * v, 2) for k, v in ms.items()}
        self.slow_step |= {"step": self.step_count, "batch": batch, "prompts": prompts}

    def _batch(self, chunks: list[DetokChunk]) -> DetokBatch | None:
        """A processed step's chunks and the requests finished since the last → one DetokBatch."""
        if not chunks and not self.scheduler.finished:
            return None
        return DetokBatch(chunks=chunks, finished=self.scheduler.take_finished(), step=self.step_count)

    @staticmethod
    def _ended(step: InFlight | None) -> bool:
        """Whether `step` has ended on the device (a device error counts: the step's wait raises
        it, where the worker handles it)."""
        return step is not None and step.ready is not None and Engine._passed(step.ready)

    # --- the prompt lanes ---------------------------------------------------------------------
    def lane_step(self) -> DetokBatch | None:
        """With the prompt lanes: collect every lane whose step has ended (→ those requests' first
        rows as audio, or None), then start waiting prompts in the free lanes, one each, while a
        step is in flight (else the next step starts them anyway) and at most
        `prompt_lane_max_batch` requests run (`Scheduler.admit_lane`).

        The rules that keep slots and KV pages apart (each lane runs on a stream of its own):
        - a lane's request takes none that the step in flight or another lane in flight may still
          write (`_lane_avoids`): what the requests of that step that ended since gave back, and
          what the request of each lane in flight holds or gave back;
        - what a lane's request gives back while its lane runs is reused only after the lane's work:
          the main stream waits on the lane's event before the next step's admission (`_fences`),
          and no other lane takes it while that lane is in flight; a lane dropped unfinished leaves
          a fence (`_lane_fences`) that each new lane's stream waits on before its admission writes;
        - the step in flight stays untouched: a lane's request joins the steps only once its row
          is on the host (`_process`), its lane's work done."""
        if not self.runner.lane_on:
            return None
        chunks: list[DetokChunk] = []
        ended = [lane for lane in self._lanes if self._lane_done(lane)]
        for lane in ended:
            self._lanes.remove(lane)
            chunks += self._process(lane, in_lane=True)
        out = self._batch(chunks) if ended else None
        fences = self._pending_fences()
        step = self._inflight
        cap = self.limits.prompt_lane_max_batch
        busy = {lane.lane for lane in self._lanes}
        free = [i for i in range(self.runner.num_lanes) if i not in busy]
        while (
            free
            and step is not None
            and self.scheduler.waiting
            and not (cap and len(self.scheduler.running) > cap)  # the lane's work would slow the steps
            and not self._ended(step)
        ):
            slots, pages = self._lane_avoids(step)
            admitting = self.runner.lane_admitting(free[0], fences)
            req = self.scheduler.admit_lane(slots, pages, self.runner.lane_fits, admitting)
            if req is None:
                break
            self._lanes.append(self.runner.launch_lane(req, free.pop(0)))
            self.lane_prompts += 1
        return out

    @property
    def waiting_on(self) -> InFlight | None:
        """The step whose results the host waits for now (`on_wait` runs meanwhile), else None."""
        return self._waiting

    def lane_ended(self) -> bool:
        """Whether a lane in flight has ended: its first row waits for `lane_step`."""
        return any(self._lane_done(lane) for lane in self._lanes)

    @classmethod
    def _lane_done(cls, lane: InFlight) -> bool:
        """Whether a lane's row is on the host: run in place (no event), or its event passed."""
        return lane.ready is None or cls._ended(lane)

    def _lane_avoids(self, step: InFlight) -> tuple[set[int], set[int]]:
        """The slots and KV pages a new lane request must not take: those the step in flight
        (`step`), and the step the host waits for meanwhile (`_waiting`), may still write, what
        their requests, and those whose slots were written ahead of them (`InFlight.touched`),
        gave back since they ended; and those of every lane in flight, what its request holds or
        gave back (its lane may still write them)."""
        slots, pages = set(), set()
        steps = [s for s in (step, self._waiting) if s is not None]
        ended = [r for s in steps for r in (*s.batch, *s.touched) if r.done]
        for r in [*ended, *(lane.batch[0] for lane in self._lanes)]:
            where = r.released if r.done else (r.slot, r.pages)
            if where is not None:
                slots.add(where[0])
                pages.update(where[1])
        return slots, pages

    def _fences(self) -> list[torch.cuda.Event]:
        """What the main stream waits on before a step's admission: each lane in flight whose
        request ended (what it gave back may go to the step's requests), and the fences of dropped
        work that have not passed."""
        ended = [lane.ready for lane in self._lanes if lane.ready is not None and lane.batch[0].done]
        return ended + self._pending_fences()

    def _pending_fences(self) -> list[torch.cuda.Event]:
        """`_lane_fences` less those the device has passed (dropped from it)."""
        self._lane_fences = [e for e in self._lane_fences if not self._passed(e)]
        return self._lane_fences

    @staticmethod
    def _passed(event) -> bool:
        """Whether the device has passed `event` (an error counts: the work it marks runs no more)."""
        try:
            return bool(event.query())
        except Exception:
            return True

    def _process(self, step: InFlight, in_lane: bool = False) -> list[DetokChunk]:
        """A completed step's sampled rows → request state, audio chunks and finished requests
        (`in_lane`: the prompt lane's, which leaves the steps' timing alone)."""
        if in_lane:
            if step.ready is not None:
                step.ready.synchronize()
            step.batch[0].lane = False
            return self._consume(step)
        self._waiting = step
        try:
            self._waited = self.runner.wait(step, self.on_wait)
        finally:
            self._waiting = None
        if self._waited > 5e-5 and self._inflight is not None:  # the next step began as this one ended
            # (by the host's clock: the earliest it may have, `ModelRunner.ended_after`)
            self._began = min(time.perf_counter(), self.runner.ended_after)
        if self.late:
            self._follow_idle()
        self.step_count += 1
        return self._consume(step)

    def _consume(self, step: InFlight) -> list[DetokChunk]:
        res = step.host.numpy()
        c = self.program.n_codebooks
        chunks: list[DetokChunk] = []
        windows, stride, due = self.windows, self.windows.stride, self.windows.due
        # Python ints and lists: a numpy scalar per row costs more than the row's whole bookkeeping.
        rows = res[:, 0].tolist() if c == 1 else res[:, :c].tolist()
        skipped = 0
        for req, row, kind in zip(step.batch, rows, res[:, c].tolist(), strict=True):
            if req.done:
                skipped += 1
                continue  # stopped or aborted while this step was in flight
            req.n_gen += 1
            if kind == _STOP:
                self._end(req, FinishReason.STOP, chunks)
                continue
            req.generated.append(row)
            if kind == _AUDIO:
                req.audio[req.n_audio] = row
                req.n_audio += 1
                # after_row makes a window only at these rows (AudioWindows.due)
                if req.n_audio % stride in due:
                    windows.after_row(req, chunks)
            if req.n_gen >= req.gen_budget:
                self._end(req, FinishReason.LENGTH, chunks)
        self.tokens_total += len(rows) - skipped
        return chunks

    def _end(self, req: Request, reason: FinishReason, chunks: list[DetokChunk]) -> None:
        """A natural end: the chunks still held back, if any (AudioWindows.flush), then the scheduler
        finishes it."""
        self.windows.flush(req, chunks)
        self.scheduler.finish(req, reason, natural=True)
