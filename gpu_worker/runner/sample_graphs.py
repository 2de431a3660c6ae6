"""CUDA graphs for a step's sampling: one per decode bucket and mode (free or constrained).

Sampling a step eagerly is some sixty small kernels (penalty, stop mask, sort, top-k/p, min-p, the
counter-based draw, classification, the slot records), each launched from Python: on the H200 at
~300 streams, launching them takes a third of the engine loop's host time. A step whose rows share
one mode replays instead the graph of the bucket that holds them, which reads that bucket's decode
graph's logits (and hidden states, for a depth step) and the arena's meta (laid out [3, bucket];
padding rows sample and record on the scratch slot) and writes [bucket, C + 1] rows and kinds. A
decode-only step's logits are there already; a step with prompts copies its own in
(`GraphRunner.sampling_inputs`). Steps mixing free and constrained rows, or a guided program's
steps with prompts, sample eagerly: the same function, so the same kernels and the same tokens.

The graph always applies the window mask and the penalty, which the eager path skips when no row
needs them; they change nothing then (a window of -1 masks nothing, x / 1 = x * 1 = x), so a row
samples the same token either way. A program's depth step (codebooks 1..C-1) runs inside the graph,
the kernels of its own graph for the bucket (gpu_worker.runner.depth_graphs), so that a step's
sampling is one launch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from common.graphs import capture

log = logging.getLogger(__name__)


class SampleGraphs:
    @torch.inference_mode()
    def __init__(
        self,
        sample: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor],
        runner,
        modes: tuple[bool, ...],
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """`sample(logits [bs, C', V], meta [3, bs], hidden [bs, H] or None, constrained)` →
        [bs, C + 1]: the engine's sampling of every row in one mode; `runner` a GraphRunner (its
        decode buckets, logits, hidden states, padded meta and scratch slot); `modes` the
        constrained settings to capture."""
        self.graphs: dict[tuple[int, bool], tuple[object, torch.Tensor]] = {}
        # A pool of its own: the backbone's graphs replay in their capture order within theirs.
        pool = torch.cuda.graph_pool_handle()
        t0 = time.monotonic()
        sizes = sorted(runner.sizes, reverse=True)
        for i, bs in enumerate(sizes):
            if progress:
                progress(f"capturing sampling graphs: batch {bs} ({i + 1}/{len(sizes)})")
            logits, meta = runner.decode_logits(bs), runner.padded_meta(bs)
            hidden = runner.decode_hidden(bs) if runner.program.n_codebooks > 1 else None
            for constrained in modes:
                # The warm-up runs for real: its rows sample and record on the scratch slot.
                meta.zero_()
                meta[0].fill_(runner.scratch_slot)
                step = lambda lg=logits, m=meta, h=hidden, c=constrained: sample(lg, m, h, c)  # noqa: E731
                self.graphs[bs, constrained] = capture(step, pool)
        log.info("captured %d sampling graphs in %.1f s", len(self.graphs), time.monotonic() - t0)

    def replay(self, bs: int, constrained: bool) -> torch.Tensor:
        """→ [bs, C + 1] the rows and kinds of the step just launched in bucket `bs` (every mode a
        request can be admitted with is captured)."""
        graph, out = self.graphs[bs, constrained]
        graph.replay()
        return out
