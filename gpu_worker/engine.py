"""The gpu_worker's engine: continuous batching over a paged KV cache, one step ahead of the host.

Each `step()`:
  1. admits waiting prompts while slots and KV pages last;
  2. launches the next step on the device: one forward pass over every running request's rows
     (whole prompts for new ones; for the others the token sampled last step, fed back on the
     device), sampling, token classification, and one device→host copy of the results; while
     steps run over the budget, streams well ahead of their listeners sit some out
     (gpu_worker.pacing.SitOut) and resume where they were;
  3. only then waits for the *previous* step's results and turns them into audio chunks and
     finished requests (one `DetokBatch`).
So the host's bookkeeping for step n overlaps the GPU's work on step n+1. The price is one step of
lag in noticing a stop token: a request that stopped is already in the step launched after it,
whose token is dropped. Everything a step needs is known ahead: positions and budgets advance by
one per step, and the audio-row count that constrained sampling depends on is kept on the device.

KV pages for a request's whole budget (max_tokens, prompt included) are reserved when it is
admitted, so a running request never runs out of pages mid-stream; when pages are short, requests
wait in arrival order instead. Freeing pages or a slot while a launched step still uses them is
safe: later writes by a new owner are queued on the same stream, after that step.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from common.config import check_headroom, check_sit_out
from common.messages import (
    DetokBatch,
    DetokChunk,
    Finished,
    FinishReason,
    Prompt,
)
from gpu_worker.kv_cache import PageAllocator, allocate_kv_cache, kv_cache_dtype, pages_for
from gpu_worker.pacing import Lives, SitOut, StepClock
from gpu_worker.requests import EngineLimits, Request
from gpu_worker.runner import StepBatch, make_runner
from gpu_worker.sampler import HeadColumns, sample_rows
from gpu_worker.slots import SlotState, to_device
from gpu_worker.windows import AudioWindows
from programs.base import LMProgram, TokenKind

log = logging.getLogger(__name__)

_STOP, _AUDIO = int(TokenKind.STOP), int(TokenKind.AUDIO)
_MAX_TOMBSTONES = 10_000


@dataclass
class _InFlight:
    batch: list[Request]
    host: torch.Tensor  # [B, C + 1] int64: sampled row, then its kind
    ready: torch.cuda.Event | None
    # GPU only, timing events: where the device reached the step's launch, and its forward pass's end
    began: torch.cuda.Event | None = None
    forwarded: torch.cuda.Event | None = None


class Engine:
    def __init__(self, program: LMProgram, limits: EngineLimits, progress=None) -> None:
        self.program = program
        self.limits = limits
        self.device = program.device
        # +1 token per request: a launched step may run once past a stop it has not seen yet.
        per_request = pages_for(limits.max_context + 1, limits.page_size)
        num_pages = limits.num_pages or 1 + limits.max_batch_size * per_request
        self.allocator = PageAllocator(num_pages)
        self.kv_cache = allocate_kv_cache(
            program.num_layers,
            num_pages,
            limits.page_size,
            program.num_kv_heads,
            program.head_dim,
            kv_cache_dtype(limits.kv_cache_dtype, program.dtype),
            self.device,
        )
        self.runner = make_runner(program, self.kv_cache, limits, progress)
        self.slots = SlotState(
            limits.max_batch_size, limits.max_context + 1, program.n_codebooks, self.device
        )
        self.stop_ids = torch.tensor(program.stop_tokens(), dtype=torch.int64, device=self.device)
        self.head: HeadColumns | None = None  # a partial output head: sample over its columns
        if program.head_ids is not None:
            self.head = HeadColumns(program.head_ids, program.vocab_size)
            self.stop_ids = self.head.column[self.stop_ids]
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._finished: list[Finished] = []
        self._inflight: _InFlight | None = None
        self._aborted: dict[str, bool] = {}  # rids aborted before their prompt arrived (bounded)
        self.step_count = 0
        self.tokens_total = 0  # sampled rows consumed, all requests
        self.last_batch_size = 0
        # rid → (generated rows as in Request.generated, stop excluded; reason) when kept (tests, benches).
        self.outputs: dict[str, tuple[list, FinishReason]] | None = None
        check_headroom(limits.realtime_headroom)
        check_headroom(limits.capacity_headroom, "--capacity-headroom")
        self.clock = StepClock(
            program.rows_per_second, limits.max_batch_size, limits.realtime_headroom, limits.capacity_headroom
        )
        # Where a step's wall time goes (exponential averages, seconds): the host's own work (admit,
        # layout, launch, consume), and waiting for the GPU to finish the previous step. A host
        # time near the step interval with little wait means the host, not the GPU, sets the pace.
        self.host_s = self.wait_s = 0.0
        self._waited = 0.0
        # On the device (exponential averages, seconds, from CUDA events): a step's forward pass
        # (prefill and decode graphs), all its work (with sampling), and how long the device sat
        # idle before it, waiting for the host to launch it. Work from other processes sharing the
        # GPU (the codec under MPS) slows these, as it slows the streams.
        self.gpu_forward_s = self.gpu_step_s = self.gpu_idle_s = 0.0
        self._last_ready: torch.cuda.Event | None = None
        self.windows = AudioWindows(program, limits.first_chunk, self.clock)
        self.sit_out = None
        check_sit_out(limits.sit_out_lead_s)
        if limits.sit_out_lead_s > 0:
            self.sit_out = SitOut(self.clock, getattr(self.runner, "sizes", None), limits.sit_out_lead_s)
        self.sitting_out = 0.0  # streams left out of a step (gpu_worker.pacing.SitOut), averaged
        # Rows a request generates before it ends (stop or budget), and their square, averaged over
        # the last ~100 that ended of themselves: what running requests grow to (`lives`).
        self.gen_rows, self.gen_rows2, self.n_ended = 0.0, 0.0, 0
        self._lives: Lives | None = None
        self.sample_graphs = None
        if hasattr(self.runner, "decode_bucket"):  # a GraphRunner
            self.capture_sampling(progress)
            self._calibrate(progress)

    # --- requests in and out -------------------------------------------------------------------
    def add(self, prompt: Prompt) -> None:
        c = self.program.n_codebooks
        if prompt.n_rows < 0 or len(prompt.tokens) != 4 * c * prompt.n_rows:
            self.reject(
                prompt.rid, f"prompt holds {len(prompt.tokens)} bytes, not {prompt.n_rows} rows of {c}"
            )
            return
        if prompt.sampling.constrained and not self.program.can_constrain:
            self.reject(prompt.rid, f"{self.program.name} has no constrained sampling mode")
            return
        rows = np.frombuffer(prompt.tokens, dtype="<i4").astype(np.int64).reshape(prompt.n_rows, c)
        budget = min(prompt.sampling.max_tokens, self.limits.max_context)
        need = pages_for(budget + 1, self.limits.page_size)
        if need > self.allocator.num_pages - 1:
            self.reject(
                prompt.rid,
                f"max_tokens={prompt.sampling.max_tokens} needs {need} KV pages, more than the whole cache "
                f"holds ({self.allocator.num_pages - 1}); lower max_tokens or raise --num-pages",
            )
            return
        if prompt.n_rows == 0 or prompt.n_rows >= budget:
            self.reject(
                prompt.rid,
                f"prompt is {prompt.n_rows} tokens, which leaves no room to generate within "
                f"max_tokens={prompt.sampling.max_tokens} (context limit {self.limits.max_context})",
            )
            return
        if rows.min() < 0 or rows.max() >= self.program.input_vocab_size:
            self.reject(prompt.rid, "prompt token ids out of range")
            return
        if self._aborted.pop(prompt.rid, False):
            self._finished.append(Finished(prompt.rid, FinishReason.ABORT))
            return
        req = Request(prompt.rid, rows, prompt.sampling, prompt.arrival, budget, urgent=prompt.urgent)
        if prompt.urgent:  # ahead of every request that has nothing playing yet
            self.waiting.insert(sum(r.urgent for r in self.waiting), req)
        else:
            self.waiting.append(req)

    def reject(self, rid: str, message: str) -> None:
        """End a request that could not start with an explicit 400."""
        self._finished.append(Finished(rid, FinishReason.ERROR, message=message, status=400))

    def abort(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return
        req = self.running.get(rid)
        if req is not None:
            self._finish(req, FinishReason.ABORT)
            return
        # The abort overtook its prompt (still in the tokenizer pool): drop the prompt on arrival.
        self._aborted[rid] = True
        while len(self._aborted) > _MAX_TOMBSTONES:
            self._aborted.pop(next(iter(self._aborted)))

    def abort_all(self) -> None:
        """Stop every request this engine holds (their gateway is gone)."""
        self._end_all(FinishReason.ABORT)

    def fail_all(self, message: str) -> None:
        """After a failed step: end every request with an explicit error and reclaim all state."""
        self._inflight = None
        self._end_all(FinishReason.ERROR, message, 500)

    def _end_all(self, reason: FinishReason, message: str = "", status: int = 0) -> None:
        for req in [*self.running.values(), *self.waiting]:
            self._finish(req, reason)
            self._finished[-1].message, self._finished[-1].status = message, status
        self.waiting.clear()

    def run_until_idle(self) -> list[DetokBatch]:
        """Step until every request has finished (offline use: tests, benchmarks)."""
        out = []
        while self.has_work():
            batch = self.step()
            if batch is not None:
                out.append(batch)
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished or self._inflight)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    def metrics(self) -> dict[str, float]:
        lives = self.lives()
        return {
            "kv_pages_used": self.allocator.num_used,
            "kv_pages_total": self.allocator.num_pages - 1,
            "decode_batch_size": self.last_batch_size,
            "streams_sitting_out": round(self.sitting_out, 1),
            "queue_depth": len(self.waiting),
            "active_streams": len(self.running),
            "generated_tokens_total": self.tokens_total,
            "steps_total": self.step_count,
            # On CPU (tests, demos) nothing is real time: admit by batch size, not by pace.
            "stream_capacity": round(
                self.clock.capacity(lives=lives)
                if self.device.type == "cuda"
                else self.limits.max_batch_size,
                1,
            ),
            "life_context": round(lives.context if lives else 0.0, 1),
            **self._step_cost(),
            "row_period_ms": round(1000 * self.clock.row_period(), 3),
            "step_host_ms": round(1000 * self.host_s, 3),
            "step_wait_ms": round(1000 * self.wait_s, 3),
            "step_gpu_forward_ms": round(1000 * self.gpu_forward_s, 3),
            "step_gpu_ms": round(1000 * self.gpu_step_s, 3),
            "step_gpu_idle_ms": round(1000 * self.gpu_idle_s, 3),
        }

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

    def _step_cost(self) -> dict[str, float]:
        """The step's cost model as fitted (gpu_worker.pacing.StepCost), for /metrics."""
        fit = self.clock.cost.coefficients()
        if fit is None:
            return {}
        a, b, c, d = fit
        return {"step_cost_fixed_ms": round(1e3 * a, 3), "step_cost_token_us": round(1e6 * b, 3),
                "step_cost_kcontext_us": round(1e6 * c, 3), "step_cost_prompt_ms": round(1e3 * d, 3)}  # fmt: skip

    def _finish(self, req: Request, reason: FinishReason, chunks: list[DetokChunk] | None = None) -> None:
        """End a request; `chunks` (a natural end) also takes its flushed last window, if any."""
        if chunks is not None:
            # what requests generate, averaged over the last ~100 that ended of themselves
            a = max(0.01, 1.0 / (self.n_ended + 1))
            self.gen_rows += a * (req.n_gen - self.gen_rows)
            self.gen_rows2 += a * (req.n_gen**2 - self.gen_rows2)
            self.n_ended += 1
            last = self.windows.flush(req)
            if last is not None:
                chunks.append(last)
        if self.outputs is not None:
            self.outputs[req.rid] = (req.generated, reason)
        req.done = True
        self.running.pop(req.rid, None)
        if req.slot >= 0:
            self.slots.release(req.slot)
            req.slot = -1
        self.allocator.free(req.pages)
        req.pages = []
        self._finished.append(
            Finished(
                req.rid, reason, n_tokens=req.n_gen, n_chunks=req.n_chunks, n_prompt_tokens=len(req.prompt)
            )
        )

    # --- one step ------------------------------------------------------------------------------
    def _admit(self) -> None:
        prefill_rows = admitted = 0
        cap = self.runner.max_prefills_per_step  # 0: no limit
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            req = self.waiting[0]
            if prefill_rows and prefill_rows + len(req.prompt) > self.limits.max_prefill_rows:
                break
            if cap and admitted >= cap:
                break
            admitted += 1
            pages = self.allocator.alloc(pages_for(req.budget + 1, self.limits.page_size))
            if pages is None:
                break  # wait for a running request to finish and free its pages
            self.waiting.popleft()
            req.pages = pages
            req.slot = self.slots.admit(req.sp, req.prompt[:, 0], self.program.uses_repetition_penalty)
            p = self.program
            req.audio = np.zeros((p.detok_preseed + req.budget, p.n_codebooks), dtype="<i4")
            req.audio[: p.detok_preseed] = p.preseed_rows()
            req.n_audio = p.detok_preseed
            req.admitted_at = time.time()
            self.running[req.rid] = req
            prefill_rows += len(req.prompt)

    def step(self) -> DetokBatch | None:
        """Launch the next step, then collect the previous one; what it produced, or None."""
        t0 = time.perf_counter()
        self._waited = 0.0
        out = self._step()
        if self.last_batch_size:
            host = time.perf_counter() - t0 - self._waited
            self.host_s += 0.05 * (host - self.host_s)
            self.wait_s += 0.05 * (self._waited - self.wait_s)
        return out

    def _step(self) -> DetokBatch | None:
        self._admit()
        # Requests whose budget is used up by launched steps wait for their last results.
        batch = [r for r in self.running.values() if len(r.prompt) + r.n_launched < r.budget]
        served = len(batch)
        n_pre = sum(r.n_ctx == 0 for r in batch)  # prompts, which never sit out
        batch = self._leave_out_streams_ahead(batch, n_pre)
        batch.sort(key=lambda r: r.n_ctx != 0)  # new requests first: runners split prefill/decode
        self.last_batch_size = len(batch)
        prompt_tokens = sum(len(r.prompt) for r in batch[:n_pre])
        cost = (len(batch) - n_pre + prompt_tokens, sum(r.n_ctx for r in batch[n_pre:]), n_pre)
        self.clock.tick(len(batch), served, cost)
        if not batch:
            self._last_ready = None  # idle: the gap before the next step is not the host's lateness
        previous, self._inflight = self._inflight, (self._launch(batch) if batch else None)
        chunks = self._consume(previous) if previous is not None else []
        if not chunks and not self._finished:
            return None
        out = DetokBatch(chunks=chunks, finished=self._finished, step=self.step_count)
        self._finished = []
        return out

    def _leave_out_streams_ahead(self, batch: list[Request], prompts: int) -> list[Request]:
        """The batch (`prompts` of its requests new) less the streams sitting this step out
        (gpu_worker.pacing.SitOut): only
        streams on their regular windows (past the tail windows of progressive mode, or a lead
        window and one more chunk), by their listener's audio in hand (sent, less played by the
        clock since the first chunk left)."""
        if self.sit_out is None or not batch:
            self.sitting_out = 0.0
            return batch
        now, progressive = self.windows.now(), self.windows.progressive
        leads = [
            r.sent_s - (now - r.t_first) if (r.switched if progressive else r.n_chunks > 1) else -np.inf
            for r in batch
        ]
        out = self.sit_out.choose(leads, prompts)
        self.sitting_out += 0.05 * (len(out) - self.sitting_out)
        if not out:
            return batch
        skip = set(out)
        return [r for i, r in enumerate(batch) if i not in skip]

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
        return StepBatch(
            ids=ids,
            pos=pos,
            qo_indptr=np.concatenate([[0], np.cumsum(rows)]).tolist(),
            kv_lens=[len(p) for p in prompts] + (dec_pos + 1).tolist(),
            page_tables=[r.pages for r in batch],
            num_prefill=n_pre,
            meta=np.ascontiguousarray(meta[:3]),
            last_rows=self.slots.last,
        )

    @torch.inference_mode()
    def _launch(self, batch: list[Request]) -> _InFlight:
        layout = self._layout(batch)
        cuda = self.device.type == "cuda"
        began = forwarded = None
        if cuda:
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        logits, meta, hidden = self.runner.forward(layout)  # [B, C', V], [3, B], [B, H] | None
        if cuda:
            forwarded = torch.cuda.Event(enable_timing=True)
            forwarded.record()
        for r in batch:
            r.n_ctx += len(r.prompt) if r.n_ctx == 0 else 1
            r.n_launched += 1
        result = self._sampled_in_graph(batch)
        if result is None:
            result = self._sample(batch, logits, meta, hidden)
        if not cuda:  # a copy: a graph's output is rewritten by its next replay
            return _InFlight(batch, result.clone(), None)
        host = torch.empty(result.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(result, non_blocking=True)
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        return _InFlight(batch, host, ready, began, forwarded)

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
    ) -> torch.Tensor:
        """Sample, classify and record every row (device work only, no host sync, so that it can be
        captured in a graph) → [B, C + 1] int64: the row, then its kind."""
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
            tokens = self.runner.decode_tokens(hidden, out, self.slots.rows(slots, n_gen, length, None))
        kinds = self.program.classify(tokens, self.slots.n_audio[slots])  # before the count moves
        self.slots.record(slots, length, tokens, kinds)
        return torch.cat([tokens, kinds[:, None]], dim=1)  # [B, C + 1]

    def _calibrate(self, progress=None) -> None:
        """Steps that differ in one part, timed before any request (gpu_worker/calibrate.py), for
        the fit behind admission. A failure leaves the fit to the steps served, as before."""
        from gpu_worker.calibrate import step_differences

        try:
            diffs = step_differences(
                self.runner, self.allocator.num_pages, self.limits.page_size, self.limits.max_context,
                self.program.n_codebooks, progress,
            )  # fmt: skip
        except Exception:
            log.exception(
                "measuring the step's parts at startup failed; admission fits them from the steps served"
            )
            return
        self.clock.cost.calibrate(diffs)

    def capture_sampling(self, progress=None) -> None:
        """Sampling graphs for the runner's decode buckets (gpu_worker/sample_graphs.py), for a
        single-codebook program."""
        if self.program.n_codebooks != 1:
            return
        from gpu_worker.sample_graphs import SampleGraphs

        self.runner.scratch_slot = self.slots.scratch  # where its padded decode rows sample
        modes = (False, True) if self.program.can_constrain else (False,)
        self.sample_graphs = SampleGraphs(self._sample_all, self.runner, modes, progress)

    def _sample_all(self, logits: torch.Tensor, meta: torch.Tensor, constrained: bool) -> torch.Tensor:
        """Every row in one mode, window and penalty applied (what a sampling graph captures)."""
        penalize = self.program.uses_repetition_penalty
        return self.sample_rows(logits, meta, None, [(slice(None), constrained, True, penalize)])

    def _sampled_in_graph(self, batch: list[Request]) -> torch.Tensor | None:
        """A decode-only step whose rows share one mode replays its bucket's sampling graph →
        [B, C + 1], or None (no graphs, prompt rows in the step, constrained and free rows mixed)."""
        graphs, bucket = self.sample_graphs, getattr(self.runner, "decode_bucket", 0)
        if graphs is None or not bucket:
            return None
        constrained = batch[0].sp.constrained
        if any(r.sp.constrained != constrained for r in batch):
            return None
        return graphs.replay(bucket, constrained)[: len(batch)]

    def _time_on_device(self, step: _InFlight) -> None:
        """Fold a completed step's device times into the averages (its events are all done)."""
        a = 0.05
        self.gpu_forward_s += a * (step.began.elapsed_time(step.forwarded) / 1000 - self.gpu_forward_s)
        self.gpu_step_s += a * (step.began.elapsed_time(step.ready) / 1000 - self.gpu_step_s)
        if self._last_ready is not None:  # the previous step's end to this one's start
            idle = self._last_ready.elapsed_time(step.began) / 1000
            self.gpu_idle_s += a * (max(0.0, idle) - self.gpu_idle_s)
        self._last_ready = step.ready

    def _consume(self, step: _InFlight) -> list[DetokChunk]:
        """A completed step's sampled rows → request state, audio chunks and finished requests."""
        if step.ready is not None:
            t0 = time.perf_counter()
            step.ready.synchronize()
            self._waited = time.perf_counter() - t0
            self._time_on_device(step)
        self.step_count += 1
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
                self._finish(req, FinishReason.STOP, chunks)
                continue
            req.generated.append(row)
            if kind == _AUDIO:
                req.audio[req.n_audio] = row
                req.n_audio += 1
                # after_row makes a window only at these rows (AudioWindows.due)
                if req.n_audio % stride in due:
                    chunk = windows.after_row(req)
                    if chunk is not None:
                        chunks.append(chunk)
            if req.n_gen >= req.gen_budget:
                self._finish(req, FinishReason.LENGTH, chunks)
        self.tokens_total += len(rows) - skipped
        return chunks
