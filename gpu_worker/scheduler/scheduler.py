"""The scheduler: which requests run when. It alone decides

- admission: which waiting requests start this step (free slots, KV pages for their whole budget,
  the caps on prompts and prompt rows per step, and as many prompts as the fitted step cost leaves
  room for beside the running streams' rows, each charged what it adds: its rows, and the group it
  opens when it cannot join one), and rejection of those that never could;
- abort and finish: a request's end, its slot and pages given back;
- consistency: a prompt whose id is already held is refused (never run in another's place), and a
  step in a state the scheduler knows is broken (a slot or KV page that no request holds) raises
  `BrokenState` instead of serving on; the worker then ends every request and `reset()` starts
  the scheduler afresh;
- sit-out: which running streams, well ahead of their listeners, leave a slow step out (`SitOut`);
- capacity: the streams this worker keeps real time (`StepClock.capacity` over the requests'
  `lives`) and the prompts it can start at once (`credits`, which the worker announces).

KV pages for a request's whole budget (max_tokens, prompt included) are reserved when it is
admitted, so a running request never runs out of pages mid-stream; when pages are short, requests
wait in arrival order instead. Freeing pages or a slot while a launched step still uses them is
safe: later writes by a new owner are queued on the same stream, after that step. Each prompt lane
(`admit_lane`) runs on a stream of its own, so a request it starts takes no slot or page that the
step in flight or another lane in flight may still write (the engine names them: what the requests
of that step that have ended since gave back, `Request.released`, and what each lane's request
holds or gave back).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from common.config import GpuWorkerSettings, check_first_audio_sit_out, check_headroom, check_sit_out
from common.messages import Finished, FinishReason, Prompt
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import PageAllocator, pages_for
from gpu_worker.runner.slots import SlotState
from gpu_worker.scheduler.pacing import StepClock, borrowable, withheld
from gpu_worker.scheduler.request import Request
from gpu_worker.scheduler.sit_out import FirstAudioSitOut, SitOut
from gpu_worker.scheduler.step_cost import Lives, PromptRoom
from gpu_worker.windows import AudioWindows, group_pace
from programs.base import LMProgram

log = logging.getLogger(__name__)

_MAX_TOMBSTONES = 10_000


# What ends a step's admission while prompts wait (`Scheduler.admission_stops`, /metrics): the batch
# or the sampling slots full, the step's cap on prompts (--max-prefills, the runner's prefill
# graphs), on prompt rows (--max-prefill-rows), the room the fitted step cost leaves beside the
# running streams, the runner's graphs taking no more prompts together, or no KV pages.
#
# How a step's prompts group (`Scheduler.admit`'s `groups`): prompts of these rows each → the groups
# they run in together (lanes, batched graphs: `GraphRunner.prompt_groups`), None where the runner's
# graphs do not take them together. Without one, all of a step's prompts run as one group (the eager
# runner's one ragged pass: `EagerRunner.prompt_groups`).
PromptGroups = Callable[[list[int]], "int | None"]


ADMISSION_STOPS = ("batch", "cap", "rows", "room", "graphs", "pages")


class BrokenState(RuntimeError):
    """The scheduler's books disagree with its slots or KV pages: what it holds cannot be trusted."""


def step_clock(program: LMProgram, limits: GpuWorkerSettings) -> StepClock:
    """The clock that paces admission, from the limits' headrooms (checked), each divided by how
    many times faster than real time the program's window groups need the LM to run
    (`group_pace`: 1 without groups)."""
    check_headroom(limits.realtime_headroom)
    check_headroom(limits.capacity_headroom, "--capacity-headroom")
    pace = group_pace(program)
    return StepClock(
        program.rows_per_second,
        limits.max_batch_size,
        limits.realtime_headroom / pace,
        limits.capacity_headroom / pace,
        trust_startup=limits.trust_startup_steps,
    )


class Scheduler:
    def __init__(
        self,
        program: LMProgram,
        limits: GpuWorkerSettings,
        num_pages: int,
        slots: SlotState,
        clock: StepClock,
        windows: AudioWindows,
        sizes: list[int] | None = None,
        real_time: bool = True,
    ) -> None:
        """`num_pages` KV pages and `slots` to hand out; `windows` say how far ahead each stream
        is; `sizes` the runner's decode buckets (sit-out rounds to them); `real_time` False (CPU:
        tests, demos) admits by batch size, not by pace."""
        self.program, self.limits, self.slots, self.clock, self.windows = (
            program,
            limits,
            slots,
            clock,
            windows,
        )
        self.allocator = PageAllocator(num_pages)
        self.real_time = real_time
        # +1 token per request: a launched step may run once past a stop it has not seen yet.
        # A guided program's request holds two KV sequences (programs.base: Classifier-free guidance).
        self.sequences = 2 if program.guidance else 1
        self.pages_per_request = self.sequences * pages_for(limits.max_context + 1, limits.page_size)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.finished: list[Finished] = []
        self._aborted: dict[str, bool] = {}  # rids aborted before their prompt arrived (bounded)
        # rid → (generated rows as in Request.generated, stop excluded; reason) when kept (tests, benches).
        self.outputs: dict[str, tuple[list, FinishReason]] | None = None
        self.last_batch_size = 0
        self.admitted_last = 0  # prompts the last step admitted
        self.admitted_groups = 0  # the groups they run in (`PromptGroups`)
        self.prompts_started = 0  # prompts admitted, all steps
        # Steps that left prompts waiting, by what stopped admission (`ADMISSION_STOPS`).
        self.admission_stops = dict.fromkeys(ADMISSION_STOPS, 0)
        self.steps_borrowing = 0  # steps whose prompts took time past the budget (--lead-borrow)
        # steps that left prompts waiting for room the playing streams could not spare (`withheld`)
        self.steps_withholding = 0
        # The last step's admission: what stopped it with prompts left waiting ("": none left, or no
        # admission yet), and the seconds of its budget withheld for the playing streams
        self.last_stop, self.last_withheld = "", 0.0
        self.sit_out = None
        check_sit_out(limits.sit_out_lead_s)
        if limits.sit_out_lead_s > 0:
            self.sit_out = SitOut(clock, sizes, limits.sit_out_lead_s)
        self.sitting_out = 0.0  # streams left out of a step (SitOut), averaged
        self.first_audio = None  # `FirstAudioSitOut` (--first-audio-sit-out)
        check_first_audio_sit_out(limits.first_audio_sit_out, limits.first_chunk)
        self.last_capacity = float(limits.max_batch_size)  # as `capacity` last said
        # the load the first-chunk decision weighs (its lane room), and with it the sit-out's pace
        windows.load = lambda: self.num_active / max(self.last_capacity, 1.0)
        if limits.first_audio_sit_out:
            spare = limits.sit_out_lead_s or GpuWorkerSettings().sit_out_lead_s
            self.first_audio = FirstAudioSitOut(clock, sizes, spare, windows.one_frame_row_s)
        # Rows a request generates before it ends (stop or budget), and their square, averaged over
        # the last ~100 that ended of themselves: what running requests grow to (`lives`).
        self.gen_rows, self.gen_rows2, self.n_ended = 0.0, 0.0, 0
        self._lives: Lives | None = None

    # --- requests in and out -------------------------------------------------------------------
    def add(self, prompt: Prompt) -> None:
        """Queue a prompt, or end it at once: a 409 when its id is already held here (the request
        holding it runs on), a 400 when it could never run."""
        c, limits = self.program.n_codebooks, self.limits
        if self.holds(prompt.rid):  # never in the place of the request holding the id
            self.reject(prompt.rid, f"request id {prompt.rid} is already held by this gpu_worker", 409)
            return
        shape_error = prompt.shape_error(c)
        if shape_error:
            self.reject(prompt.rid, f"prompt holds {shape_error}")
            return
        if prompt.sampling.constrained and not self.program.can_constrain:
            self.reject(prompt.rid, f"{self.program.name} has no constrained sampling mode")
            return
        rows = np.frombuffer(prompt.tokens, dtype="<i4").astype(np.int64).reshape(prompt.n_rows, c)
        budget = min(prompt.sampling.max_tokens, limits.max_context)
        need = self.sequences * pages_for(budget + 1, limits.page_size)
        if need > self.allocator.num_pages - 1:
            self.reject(
                prompt.rid,
                f"max_tokens={prompt.sampling.max_tokens} needs {need} KV pages, more than the whole cache "
                f"holds ({self.allocator.num_pages - 1}); lower max_tokens or raise --num-pages",
            )
            return
        if prompt.n_rows % self.sequences:
            self.reject(prompt.rid, f"a guided prompt has an even number of rows, not {prompt.n_rows}")
            return
        if prompt.n_rows == 0 or prompt.n_rows // self.sequences >= budget:
            self.reject(
                prompt.rid,
                f"prompt is {prompt.n_rows // self.sequences} tokens, which leaves no room to generate within "
                f"max_tokens={prompt.sampling.max_tokens} (context limit {limits.max_context})",
            )
            return
        if rows.min() < 0 or rows.max() >= self.program.input_vocab_size:
            self.reject(prompt.rid, "prompt token ids out of range")
            return
        state = {k: np.frombuffer(a.data, a.dtype).reshape(a.shape) for k, a in prompt.state.items()}
        state_error = self.program.check_prompt(rows, state)
        if state_error:
            self.reject(prompt.rid, f"bad prompt: {state_error}")
            return
        if self._aborted.pop(prompt.rid, False):
            self.finished.append(Finished(prompt.rid, FinishReason.ABORT))
            return
        unguided = None
        if self.program.guidance:  # the conditional prompt, then the unconditional one
            half = len(rows) // 2
            rows, unguided = rows[:half], rows[half:]
        req = Request(prompt.rid, rows, prompt.sampling, prompt.arrival, budget, prompt.urgent, state=state)
        req.unguided = unguided
        req.input_open, req.n_text = prompt.open_input, self.program.appended_rows(state)
        if req.input_open and not (self.program.appends_text and self.program.open_steps(req.n_text)):
            self.reject(prompt.rid, f"{self.program.name} takes no appended text in this prompt's mode")
            return
        if prompt.urgent:  # ahead of every request that has nothing playing yet
            self.waiting.insert(sum(r.urgent for r in self.waiting), req)
        else:
            self.waiting.append(req)

    def reject(self, rid: str, message: str, status: int = 400) -> None:
        """End a request that could not start with an explicit error (400 unless said)."""
        self.finished.append(Finished(rid, FinishReason.ERROR, message=message, status=status))

    def holds(self, rid: str) -> bool:
        """Whether a request with this id is running or waiting."""
        return rid in self.running or any(r.rid == rid for r in self.waiting)

    def abort(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.finish(req, FinishReason.ABORT)
                return
        req = self.running.get(rid)
        if req is not None:
            self.finish(req, FinishReason.ABORT)
            return
        # The abort overtook its prompt (still in the tokenizer pool): drop the prompt on arrival.
        self._aborted[rid] = True
        while len(self._aborted) > _MAX_TOMBSTONES:
            self._aborted.pop(next(iter(self._aborted)))

    def end_all(self, reason: FinishReason, message: str = "", status: int = 0) -> None:
        """End every request held, running or waiting, with `reason`."""
        for req in [*self.running.values(), *self.waiting]:
            self.finish(req, reason)
            self.finished[-1].message, self.finished[-1].status = message, status
        self.waiting.clear()

    def reset(self) -> None:
        """After `end_all`: every slot and KV page free again, whatever the books said (a state
        known to be broken is rebuilt, not served on)."""
        assert not self.running and not self.waiting, "reset only once every request has ended"
        self.slots.release_all()
        self.allocator = PageAllocator(self.allocator.num_pages)

    def check(self) -> None:
        """Raise BrokenState when a slot or KV page is held by no request (or lent twice)."""
        free_slots = self.limits.max_batch_size - len(self.running)
        if self.slots.num_free != free_slots:
            raise BrokenState(
                f"scheduler state is broken: {self.slots.num_free} free sampling slots where "
                f"{len(self.running)} running requests leave {free_slots}"
            )
        held = sum(len(r.pages) for r in self.running.values())
        if self.allocator.num_used != held:
            raise BrokenState(
                f"scheduler state is broken: {self.allocator.num_used} KV pages in use where "
                f"the running requests hold {held}"
            )

    def finish(self, req: Request, reason: FinishReason, natural: bool = False) -> None:
        """End a request and give back its slot and pages; `natural` (it stopped or used its budget)
        also counts what it generated towards `lives`."""
        if natural:
            # what requests generate, averaged over the last ~100 that ended of themselves
            a = max(0.01, 1.0 / (self.n_ended + 1))
            self.gen_rows += a * (req.n_gen - self.gen_rows)
            self.gen_rows2 += a * (req.n_gen**2 - self.gen_rows2)
            self.n_ended += 1
        if self.outputs is not None:
            self.outputs[req.rid] = (req.generated, reason)
        req.done = True
        self.running.pop(req.rid, None)
        if req.slot >= 0 or req.pages:
            req.released = (req.slot, req.pages)
        if req.slot >= 0:
            self.slots.release(req.slot)
            req.slot = -1
        self.allocator.free(req.pages)
        req.pages = []
        sent = req.n_chunks - len(req.grouped) - len(req.held)  # windows still held never leave
        self.finished.append(
            Finished(req.rid, reason, n_tokens=req.n_gen, n_chunks=sent, n_prompt_tokens=len(req.prompt))
        )

    def take_finished(self) -> list[Finished]:
        out, self.finished = self.finished, []
        return out

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self, max_prefills: int, groups: PromptGroups = EagerRunner.prompt_groups) -> list[Request]:
        """This step's batch: admit what may start (at most `max_prefills` new requests, 0: no
        limit; `groups`: how the runner groups them), leave out the streams sitting this step out,
        new requests first (the runners split prefill from decode); and tell the clock. Raises
        BrokenState (see `check`)."""
        self.check()
        self.admit(max_prefills, groups)
        # Requests whose budget is used up by launched steps wait for their last results; those
        # whose input is open and whose text runs out wait for more (gpu_worker/appends.py).
        batch = [
            r
            for r in self.running.values()
            if len(r.prompt) + r.n_launched < r.budget and not self.waits(r) and not r.lane
        ]
        served = len(batch)
        n_pre = sum(r.n_ctx == 0 for r in batch)  # prompts, which never sit out
        batch = self.leave_out_streams_ahead(batch, n_pre)
        batch.sort(key=lambda r: r.n_ctx != 0)  # new requests first: runners split prefill/decode
        self.last_batch_size = len(batch)
        prompt_tokens = sum(len(r.prompt) for r in batch[:n_pre])
        cost = (
            len(batch) - n_pre + prompt_tokens,
            sum(r.n_ctx for r in batch[n_pre:]),
            n_pre,
            min(self.admitted_groups, n_pre),  # an admitted prompt waiting for its text runs later
        )
        self.clock.tick(len(batch), served, cost)
        return batch

    def waits(self, req: Request) -> bool:
        """Whether `req`'s input is open and its text has run out (it sits out until more comes)."""
        return req.input_open and req.n_launched >= self.program.open_steps(req.n_text)

    def admit(self, max_prefills: int, groups: PromptGroups = EagerRunner.prompt_groups) -> None:
        """Waiting requests into slots, in arrival order, while slots, KV pages and this step's room
        for prompts last: at most `prefill_cap` prompts and `max_prefill_rows` prompt rows, and no
        more than the fitted step cost lets the running streams keep real time (`prompt_room`: a
        prompt costs its rows, and a group where it opens one rather than joins one: `groups`), and
        only prompts the runner's graphs take together (each rounding as alone); the first waiting
        prompt always starts (a step never admits none while slots and pages last). Then tells the
        clock what the next steps may take while prompts still wait (`StepClock.expect`)."""
        cap, limits = self.prefill_cap(max_prefills), self.limits
        fit = self.prompt_room()
        room = fit.room + fit.borrowed - fit.withheld
        prefill_rows = admitted = n_groups = 0
        spent, lengths = 0.0, []
        started: list[Request] = []  # their slots' settings written together after the loop
        stop = ""  # why prompts are left waiting, if they are
        while self.waiting:
            if len(self.running) >= limits.max_batch_size or not self.slots.num_free:
                stop = "batch"
                break
            req = self.waiting[0]
            rows = self.sequences * len(req.prompt)  # a guided request's step runs both sequences
            together = groups([*lengths, rows])
            # the fit counts one sequence a request (its terms take a guided step's factor in)
            cost = fit.cost(len(req.prompt), max(0, (together or n_groups) - n_groups))
            if admitted:
                stop = (
                    "cap" if admitted >= cap
                    else "rows" if prefill_rows + rows > limits.max_prefill_rows
                    else "graphs" if together is None
                    else "room" if spent + cost > room
                    else ""
                )  # fmt: skip
                if stop:
                    # a step the budget had room for, held back for the playing streams' next chunks
                    self.steps_withholding += stop == "room" and spent + cost <= room + fit.withheld
                    break
            pages = self.allocator.alloc(self.sequences * pages_for(req.budget + 1, limits.page_size))
            if pages is None:
                stop = "pages"
                break  # wait for a running request to finish and free its pages
            self.waiting.popleft()
            self.claim(req, pages)
            started.append(req)
            admitted += 1
            prefill_rows += rows
            spent += cost
            lengths.append(rows)
            n_groups = max(n_groups, together or 1)  # a first prompt no graph takes runs eagerly: one
        self.write_slots(started)
        self.admitted_last, self.admitted_groups = admitted, n_groups
        self.prompts_started += admitted
        if self.waiting:
            self.admission_stops[stop] += 1
        self.last_stop, self.last_withheld = (stop if self.waiting else ""), fit.withheld
        # Prompts still waiting make the next steps as heavy as this one (by the fit, else up to the
        # budget): a first chunk promised on the lighter steps before them would come late
        # (gpu_worker/windows.py). A step that may borrow (`borrowed`) is expected at its fitted time
        # as much slower as the steps served lately run (what `borrowable` allows it), and one that
        # runs past its budget is as heavy for the promises made while it is in flight, whether or
        # not prompts still wait.
        if fit.borrowed and spent > fit.room:
            self.steps_borrowing += 1
        self.clock.expect(fit.expected(spent, bool(self.waiting), self.step_budget(), self.clock.slowness()))

    def admit_lane(
        self, avoid_slots: set[int], avoid_pages: set[int], fits: Callable[[int], bool], admitting
    ) -> Request | None:
        """The first waiting request into a prompt lane (gpu_worker/runner/prompt_lane.py), or None:
        when a slot and its pages are free outside `avoid_slots` and `avoid_pages` (what the step in
        flight and the other lanes in flight may still write), its prompt `fits` a lane, and its
        input is whole (a request whose text is still coming starts in a step). Its admission writes
        go where `admitting` (a context) queues them: the lane's stream, after the fences it waits
        on. It stays out of the steps (`Request.lane`) until the engine has its first row."""
        limits = self.limits
        if not self.waiting or self.sequences != 1 or len(self.running) >= limits.max_batch_size:
            return None
        req = self.waiting[0]
        if req.input_open or not fits(len(req.prompt)) or not self.slots.free_outside(avoid_slots):
            return None
        pages = self.allocator.alloc(pages_for(req.budget + 1, limits.page_size), avoid_pages)
        if pages is None:
            return None
        self.waiting.popleft()
        with admitting:
            self.start(req, pages, avoid_slots)
        req.lane = True
        self.prompts_started += 1
        return req

    def start(
        self, req: Request, pages: list[int], avoid_slots: set[int] | frozenset[int] = frozenset()
    ) -> None:
        """A waiting request into a sampling slot (none of `avoid_slots`) with its KV pages: it runs
        from the next step."""
        self.claim(req, pages, avoid_slots)
        self.write_slots([req])

    def write_slots(self, reqs: list[Request]) -> None:
        """The sampling settings of requests that claimed their slots, in one write for them all."""
        penalty = self.program.uses_repetition_penalty
        self.slots.write(
            [r.slot for r in reqs], [(r.sp, r.prompt[:, 0], penalty, r.prompt[-1]) for r in reqs]
        )

    def claim(
        self, req: Request, pages: list[int], avoid_slots: set[int] | frozenset[int] = frozenset()
    ) -> None:
        """`start` but for its sampling settings, which `write_slots` writes (a step's admissions
        together)."""
        req.pages = pages
        p = self.program
        req.slot = self.slots.claim(avoid_slots)
        p.admit(req.slot, req.state)
        req.audio = np.zeros((req.budget, p.n_codebooks), dtype="<i4")
        req.admitted_at = time.time()
        self.running[req.rid] = req

    def prefill_cap(self, max_prefills: int) -> float:
        """Prompts one step may start: `--max-prefills` within the runner's own bound
        (`max_prefills`, its prefill graphs); 0 in both: any number."""
        caps = [n for n in (self.limits.max_prefills, max_prefills) if n > 0]
        return min(caps) if caps else math.inf

    def step_budget(self) -> float:
        """Seconds a step may take while its streams stay real time: `realtime_headroom` of the row
        period."""
        return self.clock.budget  # the limits' headroom over the group pace

    def prompt_room(self) -> PromptRoom:
        """What this step leaves for prompts: the step budget less the fitted time of the running
        streams' decode rows at their contexts (`StepCost`), each prompt at the fitted cost per
        prompt, per token and per group it opens; less what the playing streams cannot spare of the
        budget (`withheld`), and with `--lead-borrow` plus what the step may take beyond it
        (`borrowed`). Unbounded where no stream runs, nothing is paced (CPU) or the cost is not
        fitted yet (the caps alone)."""
        if not self.real_time or not self.running:
            return PromptRoom(math.inf)
        context = sum(r.n_ctx for r in self.running.values())
        budget = self.step_budget()
        room = self.clock.cost.prompt_room(budget, len(self.running), context)
        if room is None:
            return PromptRoom(math.inf)
        if len(self.waiting) > 1:  # the first prompt starts anyway
            borrow, keep = self.allowances()
            slow = self.clock.slowness()
            room = dataclasses.replace(
                room,
                borrowed=(
                    borrowable(borrow, budget, slow, self.limits.lead_borrow_max)
                    if self.limits.lead_borrow
                    else 0.0
                ),
                withheld=withheld(keep, budget),
            )
        return room

    def allowances(self) -> tuple[float, float]:
        """The longest the next step may take with every playing stream's listener fed
        (`AudioWindows.step_allowances`: its audio in hand beyond its next chunk's wait), its other
        rows taken at least a step budget each (what `--lead-borrow` borrows on) and at the clock's
        pace (what the step may take of its budget). A stream whose text has run out counts with the
        step it resumes after its text comes; one whose last rows are launched waits for no step."""
        making = [
            (r, 1 if self.waits(r) else 0)
            for r in self.running.values()
            if len(r.prompt) + r.n_launched < r.budget and not r.lane
        ]
        return self.windows.step_allowances(making)

    def leave_out_streams_ahead(self, batch: list[Request], prompts: int) -> list[Request]:
        """The batch (`prompts` of its requests new) less the streams sitting this step out
        (`SitOut`): only streams on their regular windows (past the tail windows of progressive
        mode, or a lead window and one more chunk), by their listener's audio in hand (sent, less
        played by the clock since the first chunk left); with `--max-lead`, also every stream whose
        audio in hand reaches it."""
        cap = self.limits.max_lead_s
        if (self.sit_out is None and self.first_audio is None and not cap) or not batch:
            self.sitting_out = 0.0
            return batch
        now, progressive = self.windows.now(), self.windows.progressive
        first = self.windows.clock_window + 1  # the first audible windows, sent together
        # With window groups a stream's next audio leaves only with its group's last window: its
        # lead counts the time the rows still missing from that group take at the current pace.
        row_s = self.clock.row_period_high() if self.program.detok_groups else 0.0
        leads = [
            r.sent_s - (now - r.t_first) - self.windows.rows_to_group_end(r) * row_s
            if (r.switched if progressive else r.n_chunks > first)
            else -np.inf
            for r in batch
        ]
        out = self.sit_out.choose(leads, prompts) if self.sit_out is not None else []
        if cap:  # streams past the cap (--max-lead) sit out whatever the step time
            out = sorted(set(out).union(i for i, lead in enumerate(leads) if lead >= cap))
        if self.first_audio is not None:
            self.first_audio.tick()
            if any(not r.switched for r in batch):
                # a stream's first frames wait for these steps: those ahead sit out to shorten them
                tokens = sum(len(r.prompt) for r in batch if r.n_ctx == 0)
                more = self.first_audio.choose(
                    leads, [r.n_ctx for r in batch], prompts, min(self.admitted_groups, prompts), tokens,
                    set(out), self.last_capacity,
                )  # fmt: skip
                out = sorted(set(out).union(more))
        self.sitting_out += 0.05 * (len(out) - self.sitting_out)
        if not out:
            return batch
        skip = set(out)
        return [r for i, r in enumerate(batch) if i not in skip]

    # --- capacity ------------------------------------------------------------------------------
    def credits(self) -> int:
        """Prompts this worker can start at once: free slots, and no more than the free KV pages
        cover at a full budget each (an idle worker always takes one)."""
        slots = self.limits.max_batch_size - self.num_active
        pages = self.allocator.num_free // self.pages_per_request - len(self.waiting)
        credits = min(slots, pages)
        if self.num_active == 0:
            credits = max(credits, 1)
        return max(0, credits)

    def capacity(self, lives: Lives | None) -> float:
        """Concurrent streams this worker keeps real time (`StepClock.capacity` at `lives`); its
        batch size where nothing is real time."""
        cap = self.clock.capacity(lives=lives) if self.real_time else self.limits.max_batch_size
        self.last_capacity = cap
        return cap

    def lives(self) -> Lives | None:
        """The requests this worker serves, over their lives (for `StepClock.capacity`): the
        context a running one attends over averaged over its time in a slot, its prompt and the rows
        it generates. As requests that ended of themselves generated n rows, a slot's context is on
        average its prompt and E[n^2] / (2 E[n]) (a longer request holds its slot longer), and a slot
        takes a new prompt every E[n] steps; within each running request's budget, and its budget
        before any ended. While none runs: the last prompts, and what requests generated (None
        before any ran), so that an idle worker admits as it did."""
        if not self.running:
            if self._lives is None or not self.gen_rows:
                return self._lives
            held = self.gen_rows2 / self.gen_rows
            return Lives(self._lives.prompt_tokens + 0.5 * held, self._lives.prompt_tokens, self.gen_rows)
        held = self.gen_rows2 / self.gen_rows if self.gen_rows > 0 else math.inf
        prompt = context = rows = 0.0
        for r in self.running.values():
            prompt += len(r.prompt)
            context += len(r.prompt) + 0.5 * min(r.gen_budget, held)
            rows += min(r.gen_budget, self.gen_rows or math.inf)
        n = len(self.running)
        self._lives = Lives(context=context / n, prompt_tokens=prompt / n, rows=rows / n)
        return self._lives

    def step_cost(self) -> dict[str, float]:
        """The step's cost model as fitted (`StepCost`), and how the capacity reads it where it
        extrapolates (the steps served lately against it, the rows measured: `StepClock.capacity`),
        for /metrics."""
        fit = self.clock.cost.coefficients()
        if fit is None:
            return {}
        a, b, c, d, e = fit
        return {"step_cost_fixed_ms": round(1e3 * a, 3), "step_cost_token_us": round(1e6 * b, 3),
                "step_cost_kcontext_us": round(1e6 * c, 3), "step_cost_prompt_ms": round(1e3 * d, 3),
                "step_cost_group_ms": round(1e3 * e, 3),
                "step_cost_slowness": round(self.clock.slowness(), 3),
                "step_cost_rows_measured": round(self.clock.measured_rows(), 1)}  # fmt: skip

    def calibrate(self, runner, progress=None) -> None:
        """Steps that differ in one part, timed on `runner` (a GraphRunner) before any request
        (gpu_worker/scheduler/calibrate.py), for the fit behind admission; and the largest batches'
        steps at a long context as the clock's first measurements (`StepClock.seed`). A failure
        leaves both to the steps served."""
        from gpu_worker.scheduler.calibrate import step_differences

        steps: dict[int, float] = {}
        try:
            diffs = step_differences(
                runner, self.allocator.num_pages, self.limits.page_size, self.limits.max_context,
                self.program.n_codebooks, progress, steps=steps,
            )  # fmt: skip
        except Exception:
            log.exception(
                "measuring the step's parts at startup failed; admission fits them from the steps served"
            )
            return
        self.clock.cost.calibrate(diffs)
        self.clock.seed(steps)
