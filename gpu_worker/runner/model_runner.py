"""The model runner: the step on the device, one step ahead of the host.

It owns the KV cache, the sampling slots and the forward runner (`EagerRunner`, or `GraphRunner`
with its graphs and input arena), and for each step the scheduler chose:

- `launch`: lays the step out (`StepBatch`: whole prompts for new requests; for the others the token
  sampled last step, fed back on the device), runs the forward pass, samples every row (a captured
  sampling graph where one holds the step, else eagerly; the depth step for several codebooks),
  classifies the tokens and starts one device→host copy of the results (`InFlight`);
- `wait`: waits for a launched step's copy and folds its device times into the averages.

Everything a step needs is known ahead: positions and budgets advance by one per step, and the
audio-row count that constrained sampling depends on is kept on the device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import GpuWorkerSettings, check_prompt_lanes
from common.pinned import ring
from gpu_worker.attention.select import eager_attention
from gpu_worker.runner.batch import StepBatch, kv_sequences
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache, fit_pages, kv_cache_dtype, kv_page_bytes, pages_for
from gpu_worker.runner.sampler import HeadColumns, sample_rows
from gpu_worker.runner.slots import SlotState, to_device
from programs.base import LMProgram, Rows

if TYPE_CHECKING:
    from gpu_worker.runner.prompt_lane import PromptLane
    from gpu_worker.scheduler.request import Request

log = logging.getLogger(__name__)


def make_runner(program: LMProgram, kv_cache: torch.Tensor, limits, progress=None) -> EagerRunner:
    """The forward runner: eager on CPU or on GPU without graphs; else prefill and decode graphs
    (a guided program's with both of each request's KV sequences in them)."""
    limits = limits.filled(program.device.type, program.spec["max_tokens"])
    if limits.decode_row_tile and (program.device.type == "cpu" or not limits.cuda_graphs):
        log.warning("--decode-row-tile applies to the decode graphs only: eager steps run one GEMM")
    if program.device.type == "cpu" or not limits.cuda_graphs:
        return EagerRunner(program, eager_attention(program, kv_cache, limits))
    from gpu_worker.runner.graphs import GraphRunner

    return GraphRunner(program, kv_cache, limits, progress)


@dataclass
class InFlight:
    """A launched step: its requests, and its results as they reach the host."""

    batch: list[Request]
    host: torch.Tensor  # [B, C + 1] int64: sampled row, then its kind
    ready: torch.cuda.Event | None
    # GPU only, timing events: where the device reached the step's launch, and its forward pass's end
    began: torch.cuda.Event | None = None
    forwarded: torch.cuda.Event | None = None
    lane: int | None = None  # a prompt's first step in a prompt lane: which one (else a step)
    # Requests outside `batch` whose slot the host wrote into ahead of the step, on its stream
    # (appended text): until the step has ended those writes may still run.
    touched: list[Request] = field(default_factory=list)


class ModelRunner:
    def __init__(self, program: LMProgram, limits: GpuWorkerSettings, progress=None) -> None:
        self.program = program
        self.limits = limits
        self.device = program.device
        if self.device.type == "cuda":  # the pinned rings now, not at the first request
            ring("in"), ring("out")
        # +1 token per request: a launched step may run once past a stop it has not seen yet.
        per_request = pages_for(limits.max_context + 1, limits.page_size) * kv_sequences(program)
        num_pages = limits.num_pages or 1 + limits.max_batch_size * per_request
        dtype = kv_cache_dtype(limits.kv_cache_dtype, program.dtype)
        page = (program.num_layers, limits.page_size, program.num_kv_heads, program.head_dim, dtype)
        if self.device.type == "cuda":  # what the device holds, leaving the reserve free
            page_bytes = kv_page_bytes(*page)
            wanted = num_pages
            torch.cuda.empty_cache()  # what the allocator caches (fused weights' originals) is free
            free, total = torch.cuda.mem_get_info(self.device)
            num_pages = fit_pages(
                wanted, bool(limits.num_pages), page_bytes, free, int(limits.gpu_memory_reserve * total),
                1 + per_request,
            )  # fmt: skip
            if num_pages < wanted:
                log.warning(
                    "KV cache: %d pages (%.1f full contexts) where --max-batch-size %d full contexts "
                    "need %d: the GPU's free memory less --gpu-memory-reserve %.2f of it holds no more",
                    num_pages, (num_pages - 1) / per_request, limits.max_batch_size, wanted,
                    limits.gpu_memory_reserve,
                )  # fmt: skip
        layers, page_size, heads, head_dim, dtype = page
        self.kv_cache = allocate_kv_cache(layers, num_pages, page_size, heads, head_dim, dtype, self.device)
        self.slots = SlotState(
            limits.max_batch_size, limits.max_context + 1, program.n_codebooks, self.device
        )
        # The program's per-request buffers (the scratch slot's too), before any graph captures them;
        # the attributes `init_state` bound, which this runner's graphs read (`check_state`).
        before = dict(vars(program))
        program.init_state(self.slots.scratch + 1)
        self.state = {k: v for k, v in vars(program).items() if before.get(k) is not v}
        self.forward_runner = make_runner(program, self.kv_cache, limits, progress)
        self.stop_ids = torch.tensor(program.stop_tokens(), dtype=torch.int64, device=self.device)
        self.head: HeadColumns | None = None  # a partial output head: sample over its columns
        if program.head_ids is not None:
            self.head = HeadColumns(program.head_ids, program.vocab_size)
            self.stop_ids = self.head.column[self.stop_ids]
        self.sample_graphs = None
        self.ended_after = math.inf  # of the last step waited for (`wait`)
        # The prompt lanes (gpu_worker/runner/prompt_lane.py): a graph-runner's are captured with
        # the sampling graphs; on a CPU a lane request's first step runs eagerly in its place. A GPU
        # without graphs has none: an eager lane would plan the step in flight's attention wrappers
        # again beside it.
        check_prompt_lanes(limits.prompt_lanes)
        eager_gpu = self.device.type == "cuda" and not limits.cuda_graphs
        if limits.prompt_lane == "on" and eager_gpu:
            log.warning("--prompt-lane needs CUDA graphs on a GPU: without them prompts start in the steps")
        self.lane_on = limits.prompt_lane == "on" and not program.guidance and not eager_gpu
        self.num_lanes = limits.prompt_lanes if self.lane_on else 0
        self.lanes: list[PromptLane] = []
        # On the device (exponential averages, seconds, from CUDA events): a step's forward pass
        # (prefill and decode graphs), all its work (with sampling), and how long the device sat
        # idle before it, waiting for the host to launch it. Work from other processes sharing the
        # GPU (the codec under MPS) slows these, as it slows the streams.
        self.gpu_forward_s = self.gpu_step_s = self.gpu_idle_s = 0.0
        self.last_idle_s: float | None = None  # the last step's idle before it (None: not known)
        self.last_gpu_s = 0.0  # the last step collected: its time on the device (began → ready)
        self._last_ready: torch.cuda.Event | None = None

    @property
    def num_pages(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def has_graphs(self) -> bool:
        return hasattr(self.forward_runner, "sample_bucket")  # a GraphRunner

    def check_state(self) -> None:
        """With graphs: the program still holds the per-request buffers they captured. A graph reads
        the addresses it was captured with, so after another runner's `init_state` on the same
        program (a second engine) `admit` would write buffers the graphs never read, and every step
        would run on stale state: refused (an eager runner reads the program's buffers as it runs)."""
        if self.has_graphs and any(getattr(self.program, k, None) is not v for k, v in self.state.items()):
            raise RuntimeError(
                f"{self.program.name}'s per-request state (init_state) was allocated again after this "
                "runner's CUDA graphs captured it (another engine on the same program?): its graphs "
                "would read stale state; give each engine with graphs a program of its own"
            )

    @property
    def max_prefills_per_step(self) -> int:
        """New requests one step may start (one per prefill lane); 0: any number."""
        return self.forward_runner.max_prefills_per_step

    def prompt_groups(self, rows: list[int]) -> int | None:
        """The groups prompts of `rows` rows each run in when they start in one step, each rounding
        as it would alone (`GraphRunner.prompt_groups`, `EagerRunner.prompt_groups`); None where
        they may not start together."""
        return self.forward_runner.prompt_groups(rows)

    # --- a step --------------------------------------------------------------------------------
    def layout(self, batch: list[Request]) -> StepBatch:
        """The step's rows: new requests' whole prompts, then one fed-back row per running one; a
        guided program's requests as two sequences each, side by side (`_guided`)."""
        if self.program.guidance:
            return self._guided(self._layout(batch), batch)
        return self._layout(batch)

    def _layout(self, batch: list[Request]) -> StepBatch:
        n_pre = sum(r.n_ctx == 0 for r in batch)
        prompts = [r.prompt for r in batch[:n_pre]]
        n_dec = len(batch) - n_pre
        c = self.program.n_codebooks
        ids = np.concatenate([*prompts, np.zeros((n_dec, c), dtype=np.int64)])  # decode rows fed on device
        # slot, sampled before, prompt length, n_ctx
        meta = np.array(
            [
                [r.slot for r in batch],
                [r.n_launched for r in batch],
                [len(r.prompt) for r in batch],
                [r.n_ctx for r in batch],
            ],
            dtype=np.int64,
        )
        dec_pos = meta[3, n_pre:]
        pos = np.concatenate([*(np.arange(len(p)) for p in prompts), dec_pos])
        rows = [len(p) for p in prompts] + [1] * n_dec
        # Each row's slot and step (programs.base.Rows): prompt rows -R..-1, a decode row feeds back
        # generated row n_launched - 1.
        steps = np.concatenate([*(np.arange(-len(p), 0) for p in prompts), meta[1, n_pre:] - 1])
        where = np.stack([np.repeat(meta[0], rows), steps], axis=1)  # [N, 2]
        return StepBatch(
            ids=ids,
            pos=pos,
            qo_indptr=np.concatenate([[0], np.cumsum(rows)]).tolist(),
            kv_lens=[len(p) for p in prompts] + (dec_pos + 1).tolist(),
            page_tables=[r.pages for r in batch],
            num_prefill=n_pre,
            meta=np.ascontiguousarray(meta[:3]),
            last_rows=self.slots.last,
            where=where,
        )

    @staticmethod
    def _guided(b: StepBatch, batch: list[Request]) -> StepBatch:
        """The one-sequence layout `b` of `batch` as two KV sequences per request (programs.base:
        Classifier-free guidance): each request's conditional rows then its unconditional rows, at
        the same positions and steps, each sequence on half of the request's pages. `meta` stays
        per request; `sequences` = 2 tells the runner to pair the sequences' logits."""
        ids, pos, where, lens, tables = [], [], [], [], []
        for i, r in enumerate(batch):
            lo, hi = b.qo_indptr[i], b.qo_indptr[i + 1]
            half = len(r.pages) // 2
            second = r.unguided if i < b.num_prefill else b.ids[lo:hi]
            ids += [b.ids[lo:hi], second]
            pos += [b.pos[lo:hi]] * 2
            where += [b.where[lo:hi]] * 2
            lens += [b.kv_lens[i]] * 2
            tables += [r.pages[:half], r.pages[half:]]
        rows = np.repeat(np.diff(b.qo_indptr), 2)
        return StepBatch(
            ids=np.concatenate(ids),
            pos=np.concatenate(pos),
            qo_indptr=np.concatenate([[0], np.cumsum(rows)]).tolist(),
            kv_lens=lens,
            page_tables=tables,
            num_prefill=2 * b.num_prefill,
            meta=b.meta,
            last_rows=b.last_rows,
            where=np.concatenate(where),
            sequences=2,
        )

    @torch.inference_mode()
    def launch(self, batch: list[Request]) -> InFlight:
        """Run `batch` (new requests first) on the device: forward, sampling, and the results'
        copy to the host, without waiting for any of it."""
        if batch[0].n_ctx == 0:  # new requests: their state went into the program's buffers
            self.check_state()
        layout = self.layout(batch)
        cuda = self.device.type == "cuda"
        began = forwarded = None
        if cuda:
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        logits, meta, hidden = self.forward_runner.forward(layout)  # [B, C', V], [3, B], [B, H] | None
        if cuda:
            forwarded = torch.cuda.Event(enable_timing=True)
            forwarded.record()
        for r in batch:
            r.n_ctx += len(r.prompt) if r.n_ctx == 0 else 1
            r.n_launched += 1
        result = self._sampled_in_graph(batch, logits, hidden)
        if result is None:
            result = self._sample(batch, logits, meta, hidden)
        if not cuda:  # a copy: a graph's output is rewritten by its next replay
            return InFlight(batch, result.clone(), None)
        out = ring("out")
        host = out.take(result.shape, torch.int64)
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        out.fence()
        return InFlight(batch, host, ready, began, forwarded)

    def idle(self) -> None:
        """No step this time: the gap before the next one is not the host's lateness."""
        self._last_ready = None

    def wait(self, step: InFlight, on_wait: Callable[[], None] | None = None) -> float:
        """Wait for a launched step's results on the host → the seconds waited, less those spent in
        `on_wait` (if any), which runs again and again meanwhile (it must be brief: the step's
        results wait for its return). `ended_after`: the host's time after which the step ended
        (the start of the `on_wait` call during which it ended; else the return)."""
        self.ended_after = math.inf
        if step.ready is None:
            return 0.0
        t0 = time.perf_counter()
        busy = 0.0
        if on_wait is not None:
            while not step.ready.query():
                t1 = time.perf_counter()
                on_wait()
                self.ended_after, busy = t1, busy + time.perf_counter() - t1
        step.ready.synchronize()
        now = time.perf_counter()
        waited = now - t0 - busy
        if busy == 0.0:
            self.ended_after = now
        self._time_on_device(step)
        return waited

    def _time_on_device(self, step: InFlight) -> None:
        """Fold a completed step's device times into the averages (its events are all done)."""
        a = 0.05
        self.gpu_forward_s += a * (step.began.elapsed_time(step.forwarded) / 1000 - self.gpu_forward_s)
        self.last_gpu_s = step.began.elapsed_time(step.ready) / 1000
        self.gpu_step_s += a * (self.last_gpu_s - self.gpu_step_s)
        self.last_idle_s = None
        if self._last_ready is not None:  # the previous step's end to this one's start
            self.last_idle_s = max(0.0, self._last_ready.elapsed_time(step.began) / 1000)
            self.gpu_idle_s += a * (self.last_idle_s - self.gpu_idle_s)
        self._last_ready = step.ready

    # --- sampling ------------------------------------------------------------------------------
    def _sample(
        self, batch: list[Request], logits: torch.Tensor, meta: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """Eagerly: each row's next token and its kind → [B, C + 1] int64 on the device, recorded
        in the slots. Constrained and free rows are sampled apart; every op is row-wise, so a row's
        result does not depend on which group or batch it is in."""
        groups = []
        for use_candidates in (True, False):
            group = [i for i, r in enumerate(batch) if r.sp.constrained == use_candidates]
            if not group:
                continue
            idx = to_device(torch.tensor(group), self.device) if len(group) < len(batch) else slice(None)
            # What the host knows of the group spares kernels that would change nothing: the window
            # mask when no row has a window, the penalty when every row's is 1 (x / 1 = x * 1 = x).
            windowed = any(batch[i].sp.repetition_window > 0 for i in group)
            penalize = self.program.uses_repetition_penalty and any(
                batch[i].sp.repetition_penalty != 1.0 and batch[i].sp.repetition_window != 0 for i in group
            )
            groups.append((idx, use_candidates, windowed, penalize))
        return self.sample_rows(logits, meta, hidden, groups)

    def sample_rows(
        self,
        logits: torch.Tensor,  # [B, C', V]
        meta: torch.Tensor,  # [3, B]: slot, tokens sampled before, prompt length
        hidden: torch.Tensor | None,  # [B, H] for the depth step of several codebooks
        groups: list[tuple[torch.Tensor | slice, bool, bool, bool]],  # rows, constrained, windowed, penalize
        capturing: bool = False,
    ) -> torch.Tensor:
        """Sample, classify and record every row (device work only, no host sync, so that it can be
        captured in a graph) → [B, C + 1] int64: the row, then its kind. `capturing`: inside a
        sampling graph's capture, where the depth step runs inline (the kernels its own graph
        holds) rather than as a graph of its own."""
        slots, n_gen, plen = meta
        length = n_gen + plen  # history entries: prompt + tokens sampled before this step
        out = torch.empty(slots.shape[0], dtype=torch.int64, device=self.device)
        for idx, use_candidates, windowed, penalize in groups:
            cand = self.program.candidates(self.slots.n_audio[slots[idx]]) if use_candidates else None
            rows = self.slots.rows(slots[idx], n_gen[idx], length[idx], cand, windowed, penalize)
            scores = logits[idx, 0]
            if self.head is not None:
                scores, rows = self.head.logits(scores), self.head.rows(rows)
            out[idx] = sample_rows(scores, rows, self.stop_ids)
        if self.head is not None:
            out = self.head.ids[out]
        if self.program.n_codebooks == 1:
            tokens = out[:, None]  # [B, 1]
        else:  # codebooks 1..C-1 from the program's depth step, sampled with the same settings
            where = Rows(slot=slots, step=n_gen, prev=self.slots.last[slots])
            # the depth step draws without a penalty: no history
            rows = self.slots.rows(slots, n_gen, length, None, windowed=False, penalize=False)
            depth = self.forward_runner.depth.eager if capturing else self.forward_runner.decode_tokens
            tokens = depth(hidden, out, rows, where)
        kinds = self.program.classify(tokens, self.slots.n_audio[slots])  # before the count moves
        self.slots.record(slots, length, tokens, kinds)
        return torch.cat([tokens, kinds[:, None]], dim=1)  # [B, C + 1]

    def capture_sampling(self, progress: Callable[[str], None] | None = None) -> None:
        """Sampling graphs for the forward runner's decode buckets (gpu_worker/runner/sample_graphs.py),
        a program's depth step in them."""
        from gpu_worker.runner.sample_graphs import SampleGraphs

        self.forward_runner.scratch_slot = self.slots.scratch  # where its padded decode rows sample
        modes = (False, True) if self.program.can_constrain else (False,)
        self.sample_graphs = SampleGraphs(self._sample_all, self.forward_runner, modes, progress)
        if self.num_lanes:
            from gpu_worker.runner.prompt_lane import PromptLane

            t0, held = time.monotonic(), torch.cuda.memory_reserved(self.device)
            args = (self.program, self.kv_cache, self.limits, self._sample_all, modes, self.slots.scratch)
            self.lanes = [PromptLane(*args, progress, i, self.num_lanes) for i in range(self.num_lanes)]
            log.info("captured %d prompt lanes in %.1f s (%.2f GiB of device memory)", self.num_lanes,
                     time.monotonic() - t0, (torch.cuda.memory_reserved(self.device) - held) / 2**30)  # fmt: skip

    # --- the prompt lanes ----------------------------------------------------------------------
    def lane_fits(self, rows: int) -> bool:
        """Whether a prompt of `rows` rows can start in a prompt lane (the lanes' graphs are alike)."""
        return not self.lanes or self.lanes[0].fits(rows)

    @contextlib.contextmanager
    def lane_admitting(self, lane: int, fences: list[torch.cuda.Event]):
        """Where the admission writes of a request for prompt lane `lane` go: that lane's stream
        (eagerly in place without lanes of graphs), after `fences` (events of work that may still
        write what the request takes: `Engine._lane_fences`)."""
        with self.lanes[lane].admitting() if self.lanes else contextlib.nullcontext():
            self.follow(fences)  # the current stream: the lane's
            yield

    def queued(self) -> list[torch.cuda.Event]:
        """Events marking everything queued so far on the main stream and on each lane's stream (none
        without a CUDA device): what a failure drops may still run there, including work whose
        launch raised before the engine kept a handle on it."""
        if self.device.type != "cuda":
            return []
        events = []
        for stream in [torch.cuda.current_stream(self.device), *(lane.stream for lane in self.lanes)]:
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def follow(self, events: list[torch.cuda.Event]) -> None:
        """The current stream's next work (the main stream's, or a lane's while it admits) waits for
        `events` (what a lane or dropped work may still write: `Engine._fences`)."""
        for event in events:
            event.wait()

    @torch.inference_mode()
    def launch_lane(self, req: Request, lane: int) -> InFlight:
        """The new request `req`'s first step in prompt lane `lane`, beside the step in flight
        (eagerly in its place without lanes of graphs): prefill, sampling, its row's copy to the
        host."""
        self.check_state()
        b = self.layout([req])
        if self.has_graphs:  # the steps' decode attention reads its pages by slot from now on
            self.forward_runner.attn.admit(b.meta[0, :1], [req.pages])
        req.n_ctx += len(req.prompt)
        req.n_launched += 1
        if not self.lanes:
            logits, meta, hidden = self.forward_runner.forward(b)
            result = self._sample([req], logits, meta, hidden)
            return InFlight([req], result.clone(), None, lane=lane)
        host, ready = self.lanes[lane].launch(b, req.sp.constrained)
        return InFlight([req], host, ready, lane=lane)

    def _sample_all(
        self, logits: torch.Tensor, meta: torch.Tensor, hidden: torch.Tensor | None, constrained: bool
    ) -> torch.Tensor:
        """Every row in one mode, window and penalty applied (what a sampling graph captures)."""
        penalize = self.program.uses_repetition_penalty
        return self.sample_rows(logits, meta, hidden, [(slice(None), constrained, True, penalize)], True)

    def _sampled_in_graph(
        self, batch: list[Request], logits: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor | None:
        """A step whose rows share one mode replays the sampling graph of the bucket that holds
        them, its logits and hidden states in that bucket's inputs (`GraphRunner.sampling_inputs`)
        → [B, C + 1], or None (no graphs, constrained and free rows mixed, more rows than a bucket
        holds, a guided program's prompts)."""
        if self.sample_graphs is None:
            return None
        constrained = batch[0].sp.constrained
        if any(r.sp.constrained != constrained for r in batch):
            return None
        bucket = self.forward_runner.sampling_inputs(logits, hidden)
        if not bucket:
            return None
        return self.sample_graphs.replay(bucket, constrained)[: len(batch)]
