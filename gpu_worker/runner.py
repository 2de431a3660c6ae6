"""How one step's rows run through the program: the step's layout, and the eager runner.

The engine orders a step's requests prefill first (whole prompts), then decode (one fed-back row
each), and hands the runner a `StepBatch`. `EagerRunner` runs it as one ragged forward pass with
any attention backend (torch on CPU, FlashInfer on GPU); `gpu_worker.graphs.GraphRunner` replays
CUDA graphs for the prefill part (per row bucket) and the decode part (per batch size).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.attention import StepLayout
from gpu_worker.sampler import SamplingRows, depth_sampler
from programs.base import LMProgram


@dataclass
class StepBatch:
    ids: np.ndarray  # [N, C] int64
    pos: np.ndarray  # [N] int64
    qo_indptr: list[int]  # [B+1]
    kv_lens: list[int]  # [B] context after this step
    page_tables: list[list[int]]  # [B]
    num_prefill: int  # the first num_prefill requests bring prompt rows
    # [3, B] int64 per request: sampling slot, tokens sampled before this step, prompt length.
    meta: np.ndarray | None = None
    # [S, C] device table of each slot's last sampled row: decode rows take their ids from it, so
    # fed-back tokens never leave the device. None: `ids` holds every row.
    last_rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    def part(self, lo: int, hi: int) -> StepBatch:
        """Requests [lo, hi) as a batch of their own."""
        r0, r1 = self.qo_indptr[lo], self.qo_indptr[hi]
        return StepBatch(
            ids=self.ids[r0:r1],
            pos=self.pos[r0:r1],
            qo_indptr=[i - r0 for i in self.qo_indptr[lo : hi + 1]],
            kv_lens=self.kv_lens[lo:hi],
            page_tables=self.page_tables[lo:hi],
            num_prefill=max(0, min(self.num_prefill, hi) - lo),
            meta=None if self.meta is None else self.meta[:, lo:hi],
            last_rows=self.last_rows,
        )


class EagerRunner:
    """One ragged forward pass; logits only for each request's last row."""

    max_prefills_per_step = 0  # any number of new requests per step

    def __init__(self, program: LMProgram, attn) -> None:
        self.program = program
        self.attn = attn
        self.device = program.device

    @torch.inference_mode()
    def forward(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """→ (logits [B, C', V] float32, meta [3, B] on the device, each request's last hidden state
        [B, H] when the program has several codebooks, else None) with one host→device copy."""
        dev = self.device
        n, c = b.ids.shape
        parts = [b.ids.reshape(-1), b.pos] + ([b.meta.reshape(-1)] if b.meta is not None else [])
        arena = torch.from_numpy(np.concatenate(parts)).to(dev, non_blocking=True)
        ids, pos = arena[: n * c].view(n, c), arena[n * c : n * c + n]  # [N, C], [N]
        meta = arena[n * (c + 1) :].view(3, -1) if b.meta is not None else None
        feed_decode_rows(ids, b, meta)
        self.attn.plan(StepLayout(b.qo_indptr, b.kv_lens, b.page_tables, pos))
        hidden = self.program.backbone(self.program.embed(ids), pos, self.attn)  # [N, H]
        last = torch.tensor(b.qo_indptr[1:], device=dev) - 1
        hidden = hidden[last]  # [B, H]
        keep = hidden if self.program.n_codebooks > 1 else None
        return self.program.head(hidden).float(), meta, keep

    @torch.inference_mode()
    def decode_tokens(self, hidden: torch.Tensor, c0: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """The program's depth step: [B, H], [B] → rows [B, C] int64."""
        return self.program.decode_tokens(hidden, c0, depth_sampler(rows))


def feed_decode_rows(ids: torch.Tensor, b: StepBatch, meta: torch.Tensor | None) -> None:
    """Decode rows (the last ones) take the ids sampled last step, straight from the device."""
    n_dec = b.batch_size - b.num_prefill
    if b.last_rows is not None and n_dec:
        ids[ids.shape[0] - n_dec :] = b.last_rows[meta[0, b.num_prefill :]]


def make_runner(program: LMProgram, kv_cache: torch.Tensor, limits, progress=None) -> EagerRunner:
    """Torch attention on CPU; FlashInfer on GPU, with prefill and decode graphs unless disabled."""
    if program.device.type == "cpu":
        from gpu_worker.attention import TorchPagedAttention

        return EagerRunner(program, TorchPagedAttention(kv_cache, program.num_qo_heads))
    from gpu_worker.flashinfer_backend import FlashInferAttention
    from gpu_worker.xqa_backend import resolve_decode_attention

    if not limits.cuda_graphs:
        decode = resolve_decode_attention(limits.decode_attention, kv_cache)
        attn = FlashInferAttention(
            kv_cache, program.num_qo_heads, program.dtype, limits.decode_tensor_cores, decode
        )
        return EagerRunner(program, attn)
    from gpu_worker.graphs import GraphRunner

    return GraphRunner(program, kv_cache, limits, progress)
