"""The gpu_worker's engine: continuous batching over a paged KV cache.

Each `step()` admits waiting prompts (while slots and pages last), runs one forward pass over the
ragged rows of every running request (whole prompts for new ones, one fed-back row for the
others), samples one row per request, and turns the sampled rows into audio chunks and finished
requests, returned as one `DetokBatch` for the codec.

KV pages for a request's whole budget (max_tokens, prompt included) are reserved when it is
admitted, so a running request can never run out of pages mid-stream; when pages are short,
requests wait in arrival order instead.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from common.messages import DetokBatch, DetokChunk, Finished, FinishReason, Prompt, SamplingParams
from gpu_worker.kv_cache import PageAllocator, allocate_kv_cache, pages_for
from gpu_worker.runner import StepBatch, make_runner
from gpu_worker.sampler import sample_rows
from gpu_worker.slots import SlotState
from programs.base import LMProgram, TokenKind

log = logging.getLogger(__name__)


@dataclass
class EngineLimits:
    max_batch_size: int = 16
    max_context: int = 1200
    page_size: int = 16
    num_pages: int = 0  # 0 = room for max_batch_size full contexts
    max_prefill_rows: int = 8192  # prompt rows per step, so one step never grows unbounded
    cuda_graphs: bool = True  # GPU only: replay captured decode graphs


@dataclass
class Request:
    rid: str
    prompt: np.ndarray  # [R, C] int64
    sp: SamplingParams
    arrival: float
    budget: int  # total tokens allowed, prompt included
    pages: list[int] = field(default_factory=list)
    n_ctx: int = 0  # rows written to the KV cache
    n_gen: int = 0  # rows sampled
    last: np.ndarray | None = None  # [C] the row fed back next step
    generated: list[int] = field(default_factory=list)  # codebook-0 ids fed back (stop excluded)
    slot: int = -1  # sampling-state slot while running
    audio: list[np.ndarray] = field(default_factory=list)  # audio rows, [C] each
    n_chunks: int = 0
    admitted_at: float = 0.0


class Engine:
    def __init__(self, program: LMProgram, limits: EngineLimits, progress=None) -> None:
        self.program = program
        self.limits = limits
        self.device = program.device
        if program.n_codebooks != 1:
            raise ValueError(f"{program.name}: multi-codebook sampling (decode_tokens) is not supported yet")
        num_pages = limits.num_pages or 1 + limits.max_batch_size * pages_for(
            limits.max_context, limits.page_size
        )
        self.allocator = PageAllocator(num_pages)
        self.kv_cache = allocate_kv_cache(
            program.num_layers,
            num_pages,
            limits.page_size,
            program.num_kv_heads,
            program.head_dim,
            program.dtype,
            self.device,
        )
        self.runner = make_runner(program, self.kv_cache, limits, progress)
        self.slots = SlotState(limits.max_batch_size, limits.max_context, self.device)
        self.stop_ids = torch.tensor(program.stop_tokens(), dtype=torch.int64, device=self.device)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._finished: list[Finished] = []
        self.step_count = 0
        # rid → (generated codebook-0 ids, stop token excluded; reason) when kept (tests, benches).
        self.outputs: dict[str, tuple[list[int], FinishReason]] | None = None
        s = program.detok_interval - program.detok_overlap
        if s <= 0:
            raise ValueError(f"{program.name}: detok_overlap must be smaller than detok_interval")
        self._chunk_stride = s

    # --- requests in and out -------------------------------------------------------------------
    def add(self, prompt: Prompt) -> None:
        rows = np.frombuffer(prompt.tokens, dtype="<i4").astype(np.int64)
        rows = rows.reshape(prompt.n_rows, self.program.n_codebooks)
        budget = min(prompt.sampling.max_tokens, self.limits.max_context)
        if prompt.n_rows == 0 or prompt.n_rows >= budget:
            self._finished.append(
                Finished(
                    prompt.rid,
                    FinishReason.ERROR,
                    message=f"prompt is {prompt.n_rows} tokens, which leaves no room to generate within "
                    f"max_tokens={prompt.sampling.max_tokens} (context limit {self.limits.max_context})",
                    status=400,
                )
            )
            return
        req = Request(prompt.rid, rows, prompt.sampling, prompt.arrival, budget)
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT)
                return
        req = self.running.get(rid)
        if req is not None:
            self._finish(req, FinishReason.ABORT)

    def run_until_idle(self) -> list[DetokBatch]:
        """Step until every request has finished (offline use: tests, benchmarks)."""
        out = []
        while self.has_work():
            batch = self.step()
            if batch is not None:
                out.append(batch)
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._finished)

    @property
    def num_active(self) -> int:
        return len(self.running) + len(self.waiting)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self.outputs is not None:
            self.outputs[req.rid] = (req.generated, reason)
        self.running.pop(req.rid, None)
        if req.slot >= 0:
            self.slots.release(req.slot)
            req.slot = -1
        self.allocator.free(req.pages)
        req.pages = []
        self._finished.append(Finished(req.rid, reason, n_tokens=req.n_gen, n_chunks=req.n_chunks))

    # --- one step ------------------------------------------------------------------------------
    def _admit(self) -> None:
        prefill_rows = 0
        while self.waiting and len(self.running) < self.limits.max_batch_size:
            req = self.waiting[0]
            if prefill_rows and prefill_rows + len(req.prompt) > self.limits.max_prefill_rows:
                break
            pages = self.allocator.alloc(pages_for(req.budget, self.limits.page_size))
            if pages is None:
                break  # wait for a running request to finish and free its pages
            self.waiting.popleft()
            req.pages = pages
            req.slot = self.slots.admit(req.sp, req.prompt[:, 0])
            req.admitted_at = time.time()
            self.running[req.rid] = req
            prefill_rows += len(req.prompt)

    def step(self) -> DetokBatch | None:
        """Run one step; the chunks and finished requests it produced, or None when idle."""
        self._admit()
        # New requests first: runners take the prefill part and the decode part apart.
        batch = sorted(self.running.values(), key=lambda r: r.n_ctx != 0)
        chunks: list[DetokChunk] = []
        if batch:
            tokens = self._forward_and_sample(batch)  # [B, C]
            chunks = self._consume(batch, tokens)
            self.step_count += 1
        if not chunks and not self._finished:
            return None
        out = DetokBatch(chunks=chunks, finished=self._finished, step=self.step_count)
        self._finished = []
        return out

    def _layout(self, batch: list[Request]) -> StepBatch:
        ids_rows, pos_rows, indptr, kv_lens = [], [], [0], []
        for req in batch:
            rows = req.prompt if req.n_ctx == 0 else req.last[None, :]
            ids_rows.append(rows)
            pos_rows.append(np.arange(req.n_ctx, req.n_ctx + len(rows)))
            indptr.append(indptr[-1] + len(rows))
            kv_lens.append(req.n_ctx + len(rows))
        return StepBatch(
            ids=np.concatenate(ids_rows),
            pos=np.concatenate(pos_rows),
            qo_indptr=indptr,
            kv_lens=kv_lens,
            page_tables=[req.pages for req in batch],
            num_prefill=sum(req.n_ctx == 0 for req in batch),
        )

    @torch.inference_mode()
    def _forward_and_sample(self, batch: list[Request]) -> np.ndarray:
        logits = self.runner.forward(self._layout(batch))  # [B, C, V]
        dev = self.device
        i64 = dict(dtype=torch.int64, device=dev)
        slots = torch.tensor([req.slot for req in batch], **i64)
        n_gen = torch.tensor([req.n_gen for req in batch], **i64)
        length = n_gen + torch.tensor([len(req.prompt) for req in batch], **i64)  # history entries
        out = torch.empty(len(batch), **i64)
        # Constrained and free rows are sampled apart; every op is row-wise, so a row's result
        # does not depend on which group or batch it is in.
        constrained = [i for i, req in enumerate(batch) if req.sp.constrained]
        free = [i for i, req in enumerate(batch) if not req.sp.constrained]
        for group, use_candidates in ((constrained, True), (free, False)):
            if not group:
                continue
            idx = torch.tensor(group, **i64) if len(group) < len(batch) else slice(None)
            cand = None
            if use_candidates:
                n_audio = torch.tensor([len(batch[i].audio) for i in group], **i64)
                cand = self.program.candidates(n_audio)
            rows = self.slots.rows(slots[idx], n_gen[idx], length[idx], cand)
            out[idx] = sample_rows(logits[idx, 0], rows, self.stop_ids)
        self.slots.append(slots, length, out)
        return out.cpu().numpy()[:, None]

    def _consume(self, batch: list[Request], tokens: np.ndarray) -> list[DetokChunk]:
        """Sampled rows → request state, audio chunks and finished requests."""
        n_audio = np.array([len(req.audio) for req in batch], dtype=np.int64)
        kinds = self.program.classify(tokens, n_audio)
        interval, stride = self.program.detok_interval, self._chunk_stride
        chunks: list[DetokChunk] = []
        for req, row, kind in zip(batch, tokens, kinds, strict=True):
            req.n_ctx += len(req.prompt) if req.n_ctx == 0 else 1
            req.n_gen += 1
            if kind == TokenKind.STOP:
                self._finish(req, FinishReason.STOP)
                continue
            req.last = row
            req.generated.append(int(row[0]))
            if kind == TokenKind.AUDIO:
                req.audio.append(row)
                n = len(req.audio)
                if n >= interval and (n - interval) % stride == 0:
                    start = (n - interval) // stride * stride
                    window = np.stack(req.audio[start:n]).astype("<i4")
                    chunks.append(DetokChunk(req.rid, req.n_chunks, req.sp.seed, window.tobytes()))
                    req.n_chunks += 1
            if len(req.prompt) + req.n_gen >= req.budget:
                self._finish(req, FinishReason.LENGTH)
        return chunks
