"""A step as the runners take it: its rows, laid out prefill first, then decode.

The engine orders a step's requests prefill first (whole prompts), then decode (one fed-back row
each), and hands the runner a `StepBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from programs.base import Rows


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
    # [N, 2] int64 each row's request slot and step (programs.base.Rows); None: zeros
    where: np.ndarray | None = None
    # KV sequences per request: 2 for a guided program (programs.base: Classifier-free guidance),
    # its requests' sequences side by side; `meta` stays per request.
    sequences: int = 1

    def row_where(self) -> np.ndarray:
        """[N, 2] int64 slot and step of every row (zeros when the batch carries none)."""
        if self.where is None:
            return np.zeros((len(self.pos), 2), dtype=np.int64)
        return self.where

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    def part(self, lo: int, hi: int) -> StepBatch:
        """Requests [lo, hi) as a batch of their own (one sequence per request: a guided batch's
        pairs are not split)."""
        assert self.sequences == 1, "a guided batch is not split into parts"
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
            where=None if self.where is None else self.where[r0:r1],
        )


def rows_of(where: torch.Tensor, prompt_rows: int | None = None) -> Rows:
    """The `Rows` a program's embed reads, from an [N, 2] device view of slot and step; rows
    [0, prompt_rows) are prompt rows, the rest generated rows (programs.base.Rows)."""
    return Rows(slot=where[:, 0], step=where[:, 1], prompt_rows=prompt_rows)


def feed_decode_rows(ids: torch.Tensor, b: StepBatch, meta: torch.Tensor | None) -> None:
    """Decode rows (the last ones) take the ids sampled last step, straight from the device."""
    n_dec = b.batch_size - b.num_prefill
    if b.last_rows is not None and n_dec:
        slots = meta[0, b.num_prefill // b.sequences :]
        if b.sequences > 1:  # every sequence of a request is fed the request's row
            slots = slots.repeat_interleave(b.sequences)
        ids[ids.shape[0] - n_dec :] = b.last_rows[slots]
