"""A step as the runners take it: its rows, laid out prefill first, then decode.

The engine orders a step's requests prefill first (whole prompts), then decode (one fed-back row
each), and hands the runner a `StepBatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from programs.base import LMProgram, Rows


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
        """Requests [lo, hi) as a batch of their own (a guided batch's requests with all of their
        sequences: sequence entries [S·lo, S·hi))."""
        s = self.sequences
        r0, r1 = self.qo_indptr[s * lo], self.qo_indptr[s * hi]
        return StepBatch(
            ids=self.ids[r0:r1],
            pos=self.pos[r0:r1],
            qo_indptr=[i - r0 for i in self.qo_indptr[s * lo : s * hi + 1]],
            kv_lens=self.kv_lens[s * lo : s * hi],
            page_tables=self.page_tables[s * lo : s * hi],
            num_prefill=max(0, min(self.num_prefill, s * hi) - s * lo),
            meta=None if self.meta is None else self.meta[:, lo:hi],
            last_rows=self.last_rows,
            where=None if self.where is None else self.where[r0:r1],
            sequences=s,
        )

    @property
    def num_requests(self) -> int:
        return self.batch_size // self.sequences

    def as_sequences(self, s: int) -> StepBatch:
        """A batch laid out one sequence a request as `s` sequences a request, each a copy of the
        request's rows on the request's pages: the work of a guided step of these requests, for
        steps that only time it (gpu_worker/scheduler/calibrate.py)."""
        if s == self.sequences:
            return self
        assert self.sequences == 1, "only a one-sequence batch takes more sequences"
        qo = self.qo_indptr
        rows = np.concatenate([np.arange(qo[i], qo[i + 1]) for i in range(self.batch_size) for _ in range(s)])
        return StepBatch(
            ids=self.ids[rows],
            pos=self.pos[rows],
            qo_indptr=[0, *np.cumsum(np.repeat(np.diff(qo), s)).tolist()],
            kv_lens=np.repeat(self.kv_lens, s).tolist(),
            page_tables=[t for t in self.page_tables for _ in range(s)],
            num_prefill=s * self.num_prefill,
            meta=self.meta,
            last_rows=self.last_rows,
            where=None if self.where is None else self.where[rows],
            sequences=s,
        )


def kv_sequences(program: LMProgram) -> int:
    """KV sequences a request of `program` runs: 2 with classifier-free guidance, else 1."""
    return 2 if program.guidance else 1


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


def paired(
    program: LMProgram, logits: torch.Tensor, hidden: torch.Tensor, slot: torch.Tensor, sequences: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's last rows, one per KV sequence (S = `sequences` consecutive rows a request,
    conditional first), as the request's: logits [S·B, C', V] → the program's guided logits
    [B, C', V] (`guide`, with each request's slot read from `slot` [S·B] at its first row), hidden
    [S·B, H] → the conditional sequence's [B, H]. One sequence: both unchanged. Device work only
    (captured in graphs); the one place the runners pair sequences."""
    if sequences == 1:
        return logits, hidden
    pairs = logits.view(-1, sequences, *logits.shape[1:])  # [B, S, C', V]
    return program.guide(pairs, slot[::sequences]), hidden[::sequences]


def sequence_slots(slots: np.ndarray | torch.Tensor, sequences: int):
    """Requests' slots [B] → their KV sequences' [S·B] (slot·S + s, conditional first): where a
    graph attention backend keeps a sequence's pages (XQA's table rows)."""
    if sequences == 1:
        return slots
    if isinstance(slots, np.ndarray):
        return (slots[:, None] * sequences + np.arange(sequences)).reshape(-1)
    return (slots[:, None] * sequences + torch.arange(sequences, device=slots.device)).reshape(-1)
