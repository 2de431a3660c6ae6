"""The prompt lanes: a new request's first step beside the step in flight, on a stream of its own.

A prompt that arrives while a step runs on the device would otherwise wait for that step to end and
then for the whole next step: for a model whose step takes ~10 ms (a 16-codebook model's depth
step is most of it), that wait is much of its first audio under load. A lane starts the prompt at
once: its prefill (a prefill graph of the lane's own) and its first sampling (a sampling graph for
one row, the program's depth step inside it) run on a CUDA stream of their own while the step in
flight goes on; small steps leave most of the GPU's SMs idle, so the two overlap. Once the host has
the lane's row, the request runs in the engine's steps like any other (gpu_worker/engine.py:
`Engine.lane_step`). With `--prompt-lanes N` there are N lanes, each a `PromptLane`, so that N
prompts can start beside the step in flight at once; a prompt that finds every lane busy waits for
one or for the next step.

Nothing a lane touches is touched by the step in flight or by another lane: each lane has its own
stream, input arena, attention wrappers (their own workspace), graph pools, cuBLAS workspace (its
graphs are captured on its own stream) and sampling inputs. The rules that keep the slots and KV
pages apart (`Engine.lane_step`, `Scheduler.admit_lane`):

- a lane's request takes no slot or page that the step in flight or another lane in flight may
  still write: none that a request of that step gave back since (it ended while the step ran), and
  none that the request of another lane in flight holds or gave back;
- what a lane's request gives back while its lane runs (an abort) is reused only after the lane's
  work: the main stream waits on the lane's event before a step's admission, and another lane
  takes none of it while that lane is in flight; a lane the engine drops unfinished (after a failed
  step) leaves a fence (`Engine._lane_fences`) that the main stream and every lane's stream wait on
  before their admission writes;
- a lane's admission writes are queued on its own stream, ahead of its step, and the step in
  flight stays untouched: the engine includes the request in a step only after the lane's row
  reached the host, so the main stream never reads what a lane has not written.

A request's first row is the one it samples alone: a lane's prefill graphs are those of a step's
prefill lanes (one request each, so the same rounding), and its sampling is the same function as
every step's. Guided programs (two KV sequences a request) take no lane.

Without streams (a CPU, an eager runner) the engine runs a lane request's first step eagerly in its
place (`ModelRunner.launch_lane`), so that its handling is the same everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.graphs import capture
from common.pinned import ring
from gpu_worker.attention.select import graph_attention
from gpu_worker.runner.arena import InputArena
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.prefill_graphs import (
    PrefillGraphs,
    fill_prefill,
    max_prefill_pages,
    pick_bucket,
    prefill_buckets,
    prefill_spans,
)
from programs.base import LMProgram

log = logging.getLogger(__name__)


def lane_prefix(index: int) -> str:
    """A prompt lane's arena span prefix (each lane has an arena of its own; the prefix names its
    graphs in the startup progress)."""
    return "s_" if index == 0 else f"s{index}_"


# sample(logits [1, C', V], meta [3, 1], hidden [1, H] or None, constrained) → [1, C + 1]
Sample = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor]


class PromptLane:
    """One prompt at a time, its prefill and first sampling as two graph replays on a side stream;
    lane `index` of `count`."""

    def __init__(
        self,
        program: LMProgram,
        kv_cache: torch.Tensor,
        limits,
        sample: Sample,
        modes: tuple[bool, ...],
        scratch_slot: int,
        progress: Callable[[str], None] | None = None,
        index: int = 0,
        count: int = 1,
    ) -> None:
        self.program = program
        self.index = index
        x = self.prefix = lane_prefix(index)
        dev, c = program.device, program.n_codebooks
        # High priority: the GPU's scheduler prefers the lane's kernels to the step's, so the first
        # row comes soon. The lane's graphs are captured on this stream too: a captured GEMM keeps
        # its capture stream's cuBLAS workspace, and the steps' graphs (captured on torch's capture
        # stream) must not share it with the lane's while both run.
        self.stream = torch.cuda.Stream(device=dev, priority=-1)
        self.page_size = kv_cache.shape[3]
        buckets = prefill_buckets(limits.max_context, 1)
        rows, reqs = buckets[-1]
        p_pages = max_prefill_pages(rows, reqs, limits.max_context, self.page_size)
        self.arena = InputArena({x + "meta": 3} | prefill_spans(rows, reqs, c, p_pages, x), dev)
        # attention of its own: FlashInfer's wrappers share their backend's workspace
        _, self.attn = graph_attention(program, kv_cache, limits, 1, p_pages, 1)
        pool = torch.cuda.graph_pool_handle()
        t0 = time.monotonic()
        self.prefill = PrefillGraphs(program, kv_cache, self.arena, self.attn, pool, buckets, p_pages, progress,
                                     x, self.stream)  # fmt: skip
        # the sampling graphs' inputs, where a replay's prefill graph (one per bucket) copies its outputs
        logits, hidden = next(iter(self.prefill.graphs.values()))[2]
        self.logits = torch.zeros_like(logits[:1])  # [1, C', V]
        self.hidden = torch.zeros_like(hidden[:1]) if c > 1 else None  # [1, H]
        self.meta = self.arena.dev_view(x + "meta").view(3, 1)
        self.samples: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        spool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for constrained in modes:
                if progress:
                    progress(
                        f"capturing prompt lane {index + 1}/{count}'s sampling graph "
                        f"({'constrained' if constrained else 'free'})"
                    )
                self.meta.zero_()  # the warm-up samples for real, on the scratch slot
                self.meta[0].fill_(scratch_slot)
                self.samples[constrained] = capture(
                    lambda m=constrained: sample(self.logits, self.meta, self.hidden, m), spool, self.stream
                )
        log.info("captured prompt lane %d/%d: %d prefill graphs and %d sampling graphs in %.1f s",
                 index + 1, count, len(self.prefill.graphs), len(self.samples), time.monotonic() - t0)  # fmt: skip

    def fits(self, rows: int) -> bool:
        """Whether a prompt of `rows` rows fits one of the lane's prefill graphs."""
        return pick_bucket(self.prefill.buckets, 1, rows) is not None

    def admitting(self):
        """The context in which a lane request's admission writes are queued: the lane's stream."""
        return torch.cuda.stream(self.stream)

    @torch.inference_mode()
    def launch(self, b: StepBatch, constrained: bool) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Run the one-prompt batch `b` (with its meta) on the lane's stream → (its row and kind
        [1, C + 1] in pinned host memory, the event that marks them there)."""
        lay = self.prefill.layout(b)
        assert lay is not None, "a lane prompt fits a prefill graph (`fits`)"
        a, x = self.arena, self.prefix
        upto = a.spans[x + "kv"][0] + len(lay.kv_indices)
        with torch.cuda.stream(self.stream):
            a.begin(upto)
            fill_prefill(a, b, lay, x)
            a.host_view(x + "meta").copy_(torch.from_numpy(b.meta.reshape(-1)))
            a.send(upto)
            self.prefill.plan(lay)
            a.seal()
            logits, hidden = self.prefill.replay(lay)
            self.logits.copy_(logits)
            if self.hidden is not None:
                self.hidden.copy_(hidden)
            graph, out = self.samples[constrained]
            graph.replay()
            results = ring("out")
            host = results.take(out.shape, torch.int64)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            results.fence()
        return host, ready
