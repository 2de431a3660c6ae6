"""The eager runner: one ragged forward pass over a step's rows with any attention backend
(torch on CPU, FlashInfer on GPU). `gpu_worker.runner.graphs.GraphRunner` replays CUDA graphs for
the prefill part (per row bucket) and the decode part (per batch size) instead, and falls back to
this runner for steps no graph holds.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.attention.interface import EagerAttention, StepLayout
from gpu_worker.runner.batch import StepBatch, feed_decode_rows, paired, rows_of
from gpu_worker.runner.sampler import SamplingRows, depth_sampler
from programs.base import LMProgram, Rows


class EagerRunner:
    """One ragged forward pass; logits only for each request's last row."""

    max_prefills_per_step = 0  # any number of new requests per step

    @staticmethod
    def prompt_groups(rows: list[int]) -> int:
        """The groups a step's prompts of `rows` rows each run in: all in its one ragged pass."""
        return 1 if rows else 0

    def __init__(self, program: LMProgram, attn: EagerAttention) -> None:
        self.program = program
        self.attn = attn
        self.device = program.device

    @torch.inference_mode()
    def forward(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """→ (logits [B, C', V] float32, meta [3, B] on the device, each request's last hidden state
        [B, H] when the program has several codebooks, else None) with one host→device copy."""
        dev = self.device
        n, c = b.ids.shape
        parts = [b.ids.reshape(-1), b.pos, b.row_where().reshape(-1)]
        parts += [b.meta.reshape(-1)] if b.meta is not None else []
        arena = torch.from_numpy(np.concatenate(parts)).to(dev, non_blocking=True)
        ids, pos = arena[: n * c].view(n, c), arena[n * c : n * c + n]  # [N, C], [N]
        where = arena[n * (c + 1) : n * (c + 3)].view(n, 2)  # [N, 2] slot, step
        meta = arena[n * (c + 3) :].view(3, -1) if b.meta is not None else None
        feed_decode_rows(ids, b, meta)
        self.attn.plan(StepLayout(b.qo_indptr, b.kv_lens, b.page_tables, pos))
        rows = rows_of(where, prompt_rows=b.qo_indptr[b.num_prefill])  # prompts first
        hidden = self.program.backbone(self.program.embed(ids, rows), pos, self.attn)  # [N, H]
        last = torch.tensor(b.qo_indptr[1:], device=dev) - 1
        hidden = hidden[last]  # [B, H] ([S·B, H] with S sequences per request)
        logits = self.program.head(hidden).float()
        # a guided program: each request's sequences → its logits, its slot read from its rows (a
        # prefill part that the graph runner runs here carries no meta)
        logits, hidden = paired(self.program, logits, hidden, where[last, 0], b.sequences)
        keep = hidden if self.program.n_codebooks > 1 else None
        return logits, meta, keep

    @torch.inference_mode()
    def decode_tokens(
        self, hidden: torch.Tensor, c0: torch.Tensor, rows: SamplingRows, where: Rows
    ) -> torch.Tensor:
        """The program's depth step: [B, H], [B] → rows [B, C] int64."""
        return self.program.decode_tokens(hidden, c0, depth_sampler(rows, self.program.n_codebooks), where)
