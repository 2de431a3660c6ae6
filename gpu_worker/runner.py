"""How one step's rows run through the program: the step's layout, and the eager runner.

The engine orders a step's requests prefill first (whole prompts), then decode (one fed-back row
each), and hands the runner a `StepBatch`. `EagerRunner` runs it as one ragged forward pass with
any attention backend (torch on CPU, FlashInfer on GPU); `gpu_worker.graphs.GraphRunner` replays
CUDA graphs for the decode part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import StepLayout
from programs.base import LMProgram


@dataclass
class StepBatch:
    ids: np.ndarray  # [N, C] int64
    pos: np.ndarray  # [N] int64
    qo_indptr: list[int]  # [B+1]
    kv_lens: list[int]  # [B] context after this step
    page_tables: list[list[int]]  # [B]
    num_prefill: int  # the first num_prefill requests bring prompt rows
    feedback: torch.Tensor | None = None  # [B - num_prefill, C] device ids of the decode rows

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    def part(self, lo: int, hi: int) -> StepBatch:
        """Requests [lo, hi) as a batch of their own."""
        r0, r1 = self.qo_indptr[lo], self.qo_indptr[hi]
        fb = None
        if self.feedback is not None and hi > self.num_prefill:
            fb = self.feedback[max(lo - self.num_prefill, 0) : hi - self.num_prefill]
        return StepBatch(
            ids=self.ids[r0:r1],
            pos=self.pos[r0:r1],
            qo_indptr=[i - r0 for i in self.qo_indptr[lo : hi + 1]],
            kv_lens=self.kv_lens[lo:hi],
            page_tables=self.page_tables[lo:hi],
            num_prefill=max(0, min(self.num_prefill, hi) - lo),
            feedback=fb,
        )


class EagerRunner:
    """One ragged forward pass; logits only for each request's last row."""

    def __init__(self, program: LMProgram, attn) -> None:
        self.program = program
        self.attn = attn
        self.device = program.device

    @torch.inference_mode()
    def forward(self, b: StepBatch) -> torch.Tensor:
        """→ logits [B, C, V] float32 on the device."""
        dev = self.device
        ids = torch.from_numpy(b.ids).to(dev, non_blocking=True)  # [N, C]
        if b.feedback is not None:  # decode rows are the last ones; their ids never left the device
            ids[ids.shape[0] - b.feedback.shape[0] :] = b.feedback
        pos = torch.from_numpy(b.pos).to(dev, non_blocking=True)  # [N]
        self.attn.plan(StepLayout(b.qo_indptr, b.kv_lens, b.page_tables, pos))
        hidden = self.program.backbone(self.program.embed(ids), pos, self.attn)  # [N, H]
        last = torch.tensor(b.qo_indptr[1:], device=dev) - 1
        return self.program.head(hidden[last]).float()


def make_runner(program: LMProgram, kv_cache: torch.Tensor, limits, progress=None) -> EagerRunner:
    """Torch attention on CPU; FlashInfer on GPU, with decode graphs unless disabled."""
    if program.device.type == "cpu":
        from gpu_worker.attention import TorchPagedAttention

        return EagerRunner(program, TorchPagedAttention(kv_cache, program.num_qo_heads))
    from gpu_worker.flashinfer_backend import FlashInferAttention

    if not limits.cuda_graphs:
        return EagerRunner(program, FlashInferAttention(kv_cache, program.num_qo_heads))
    from gpu_worker.graphs import GraphRunner

    return GraphRunner(program, kv_cache, limits, progress)
