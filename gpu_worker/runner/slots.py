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
from common.pinned import to_device
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
        """Claim a slot for a request whose codebook-0 prompt ids are `prompt_ids` [R] and write
        its settings (`claim`, then `write`)."""
        slot = self.claim(avoid)
        self.write([slot], [(sp, prompt_ids, penalty, last_row)])
        return slot

    def claim(self, avoid: set[int] | frozenset[int] = frozenset()) -> int:
        """A free slot not in `avoid` (`free_outside` says one is left), its settings still to
        `write`."""
        i = next(i for i in range(len(self._free) - 1, -1, -1) if self._free[i] not in avoid)
        return self._free.pop(i)

    def write(self, slots: list[int], requests: list[tuple]) -> None:
        """The settings of new requests into their claimed `slots`, each of `requests` (sampling
        params, codebook-0 prompt ids [R], penalty, last row [C] or None). With `penalty` False (a
        program without one) the penalty is off and the prompt stays out of the history: its ids
        need not be sampleable (a program's text rows). The last row is the prompt's, the
        request's previous row when it samples its first (programs.base.Rows.prev).

        All of them at once: one copy per tensor (floats, ints, histories, last rows, the slots),
        from pinned memory (the process's ring) without waiting. A write from pageable memory (a
        Python number into a device tensor, say) waits for every step queued on the stream,
        stalling the host's lead; a fresh pinned block a write can cost milliseconds; and a copy a
        request costs a burst's step the host time of several launches per prompt."""
        k = len(slots)
        if not k:
            return
        floats = np.empty((k, 4), dtype=np.float32)
        ints = np.empty((k, 4), dtype=np.int64)
        history = np.empty((k, self.history.shape[1]), dtype=np.int64)
        last = np.zeros((k, self.last.shape[1]), dtype=np.int64)
        has_last = np.zeros(k, dtype=bool)
        for j, (sp, prompt_ids, penalty, last_row) in enumerate(requests):
            if not penalty:
                sp, prompt_ids = msgspec.structs.replace(sp, repetition_penalty=1.0), np.zeros(1, np.int64)
            rep = sp.repetition_penalty if sp.repetition_window != 0 else 1.0
            floats[j] = (sp.temperature, sp.top_p, sp.min_p, rep)
            ints[j] = (sp.top_k, sp.repetition_window, sp.seed, sp.min_tokens)
            history[j] = prompt_ids[0]
            history[j, : len(prompt_ids)] = prompt_ids
            if last_row is not None:
                last[j], has_last[j] = np.asarray(last_row, dtype=np.int64), True

        def dev(a: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(a), self.device)

        ids = np.asarray(slots, dtype=np.int64)
        idx = dev(ids)
        self.floats.index_copy_(0, idx, dev(floats))
        self.ints.index_copy_(0, idx, dev(ints))
        self.history.index_copy_(0, idx, dev(history))
        if has_last.all():
            self.last.index_copy_(0, idx, dev(last))
        elif has_last.any():
            self.last.index_copy_(0, dev(ids[has_last]), dev(last[has_last]))
        self.n_audio.index_fill_(0, idx, 0)

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
