"""CUDA graphs for a decode step's sampling: one per decode bucket and mode (free or constrained).

Sampling a step eagerly is some sixty small kernels (penalty, stop mask, sort, top-k/p, min-p, the
counter-based draw, classification, the slot records), each launched from Python: on the H200 at
~300 streams, launching them takes a third of the engine loop's host time. A decode-only
step whose rows share one mode replays instead the graph of its bucket, which reads the decode
graph's logits and the arena's meta (laid out [3, bucket]; padding rows sample and record on the
scratch slot) and writes [bucket, C + 1] rows and kinds. Steps with prompt rows, or mixing free and
constrained rows, sample eagerly: the same function, so the same kernels and the same tokens.

The graph always applies the window mask and the penalty, which the eager path skips when no row
needs them; they change nothing then (a window of -1 masks nothing, x / 1 = x * 1 = x), so a row
samples the same token either way. Single-codebook programs only: a depth step has graphs of its
own (gpu_worker.runner.depth_graphs).
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
        sample: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
        runner,
        modes: tuple[bool, ...],
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """`sample(logits [bs, C', V], meta [3, bs], constrained)` → [bs, C + 1]: the engine's
        sampling of every row in one mode; `runner` a GraphRunner (its decode buckets, logits,
        padded meta and scratch slot); `modes` the constrained settings to capture."""
        self.graphs: dict[tuple[int, bool], tuple[object, torch.Tensor]] = {}
        # A pool of its own: the backbone's graphs replay in their capture order within theirs.
        pool = torch.cuda.graph_pool_handle()
        t0 = time.monotonic()
        sizes = sorted(runner.sizes, reverse=True)
        for i, bs in enumerate(sizes):
            if progress:
                progress(f"capturing sampling graphs: batch {bs} ({i + 1}/{len(sizes)})")
            logits, meta = runner.decode_logits(bs), runner.padded_meta(bs)
            for constrained in modes:
                # The warm-up runs for real: its rows sample and record on the scratch slot.
                meta.zero_()
                meta[0].fill_(runner.scratch_slot)
                step = lambda lg=logits, m=meta, c=constrained: sample(lg, m, c)  # noqa: E731
                self.graphs[bs, constrained] = capture(step, pool)
        log.info("captured %d sampling graphs in %.1f s", len(self.graphs), time.monotonic() - t0)

    def replay(self, bs: int, constrained: bool) -> torch.Tensor:
        """→ [bs, C + 1] the rows and kinds of the step just launched in bucket `bs` (every mode a
        request can be admitted with is captured)."""
        graph, out = self.graphs[bs, constrained]
        graph.replay()
        return out
