"""Per-slot sampling state on the device.

Each running request owns a slot: its sampling parameters are written once at admission, and its
token history (prompt + output, for the repetition penalty) grows by one device write per step,
so a step builds its `SamplingRows` by indexing with the batch's slot ids instead of copying
Python lists of every request's history.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from common.messages import SamplingParams
from common.pinned import ring, to_device
from gpu_worker.runner.sampler import SamplingRows
from programs.base import TokenKind

__all__ = ["SlotState", "to_device"]  # to_device: for programs' own per-slot state at admission


class SlotState:
    """`num_slots` slots for requests, and one more, `scratch` (never handed out): the padding rows
    of a captured step (gpu_worker/runner/sample_graphs.py) sample and record there, harmlessly."""

    def __init__(self, num_slots: int, max_context: int, n_codebooks: int, device: torch.device) -> None:
        self.scratch = num_slots
        num_slots += 1
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.device = device
        # A request's settings, written at admission with one copy per dtype (columns below).
        self.floats = torch.zeros(num_slots, 4, **f32)
        self.ints = torch.zeros(num_slots, 4, **i64)
        self.temperature, self.top_p, self.min_p, self.penalty = self.floats.unbind(1)
        self.top_k, self.window, self.seed, self.min_tokens = self.ints.unbind(1)
        self.top_p.fill_(1.0)
        self.penalty.fill_(1.0)
        self.window.fill_(-1)
        # Positions past a request's length hold its first prompt token: gathering or scattering
        # a token that is already in the row changes nothing, so no mask is needed without a window.
        self.history = torch.zeros(num_slots, max_context, **i64)  # [S, T]
        self.last = torch.zeros(num_slots, n_codebooks, **i64)  # [S, C] the row fed back next step
        self.n_audio = torch.zeros(num_slots, **i64)  # [S] rows classified AUDIO so far
        self._free = list(range(self.scratch - 1, -1, -1))

    def admit(
        self,
        sp: SamplingParams,
        prompt_ids: np.ndarray,
        penalty: bool = True,
        last_row: np.ndarray | None = None,
        avoid: set[int] | frozenset[int] = frozenset(),
    ) -> int:
        """Claim a slot for a request whose codebook-0 prompt ids are `prompt_ids` [R]. With
        `penalty` False (a program without one) the penalty is off and the prompt stays out of the
        history: its ids need not be sampleable (a program's text rows). `last_row` [C]: the
        prompt's last row, the request's previous row when it samples its first
        (programs.base.Rows.prev). `avoid`: slots not to take (`free_outside` says one is left)."""
        i = next(i for i in range(len(self._free) - 1, -1, -1) if self._free[i] not in avoid)
        slot = self._free.pop(i)
        if not penalty:
            sp, prompt_ids = msgspec.structs.replace(sp, repetition_penalty=1.0), np.zeros(1, np.int64)
        penalty = sp.repetition_penalty if sp.repetition_window != 0 else 1.0
        floats = torch.tensor([sp.temperature, sp.top_p, sp.min_p, penalty], dtype=torch.float32)
        ints = torch.tensor([sp.top_k, sp.repetition_window, sp.seed, sp.min_tokens], dtype=torch.int64)
        history = np.full(self.history.shape[1], prompt_ids[0], dtype=np.int64)
        history[: len(prompt_ids)] = prompt_ids
        rows = [(self.floats, floats), (self.ints, ints), (self.history, torch.from_numpy(history))]
        if last_row is not None:
            rows.append((self.last, torch.from_numpy(np.asarray(last_row, dtype=np.int64))))
        # From pinned memory (the process's ring), without waiting: a write from pageable memory (a
        # Python number into a device tensor, say) waits for every step queued on the stream,
        # stalling the host's lead; a fresh pinned block a write can cost milliseconds.
        cuda = self.device.type == "cuda"
        for dst, src in rows:
            dst[slot].copy_(ring().stage(src) if cuda else src, non_blocking=cuda)
        if cuda:
            ring().fence()
        self.n_audio[slot : slot + 1].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def release_all(self) -> None:
        """Every slot free (the scheduler's reset, once no request runs)."""
        self._free = list(range(self.scratch - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_outside(self, avoid: set[int] | frozenset[int]) -> bool:
        """Whether a free slot is left outside `avoid`."""
        return any(s not in avoid for s in self._free)

    def record(
        self, slots: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, kinds: torch.Tensor
    ) -> None:
        """After sampling: tokens [B, C] become each slot's history entry at `pos`, its next input,
        and (when AUDIO) one more audio row."""
        self.history[slots, pos] = tokens[:, 0]
        self.last[slots] = tokens
        self.n_audio[slots] += (kinds == TokenKind.AUDIO).to(torch.int64)

    def rows(
        self,
        slots: torch.Tensor,  # [B] int64
        n_gen: torch.Tensor,  # [B] int64 tokens generated so far
        length: torch.Tensor,  # [B] int64 valid history entries
        candidates: torch.Tensor | None,
        windowed: bool = True,
        penalize: bool = True,
    ) -> SamplingRows:
        """`windowed` False: no row has a repetition window, so the masking below would change
        nothing; `penalize` False: no row's penalty differs from 1, so no history is needed."""
        hist = self.history[slots] if penalize else None  # [B, T]
        if windowed and hist is not None:
            window = self.window[slots]
            # A windowed penalty sees only the last `window` tokens: older entries (and the padding
            # past the length) are replaced by the newest token, which is always in the window.
            pos = torch.arange(hist.shape[1], device=hist.device)[None, :]
            outside = (window[:, None] > 0) & ((pos < (length - window)[:, None]) | (pos >= length[:, None]))
            newest = hist.gather(1, (length - 1).clamp_min(0)[:, None])
            hist = torch.where(outside, newest, hist)
        return SamplingRows(
            temperature=self.temperature[slots],
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            rep_penalty=self.penalty[slots],
            seed=self.seed[slots],
            counter=n_gen,
            history=hist,
            block_stop=n_gen < self.min_tokens[slots],
            candidates=candidates,
        )
