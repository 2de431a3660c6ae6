"""Which codec windows a request's audio rows make, and when (programs/base.py: "Audio chunks",
"Lead windows", "Stream edges").

Regular window j holds audio rows [j*s, j*s + detok_interval) (s = detok_interval - detok_overlap)
and goes out when its last row exists. Before it, a request may send one *lead window* of R rows
(a `detok_lead` size) when the engine's measured step rate says the next regular window will arrive
before the lead has played out; the regular windows whose audio the lead covers are then skipped.
After its last row, a program with `detok_flush` sends the rows past the last window in one more
window, padded past the end.
"""

from __future__ import annotations

import numpy as np

from common.messages import LEAD_NOISE_BASE, DetokChunk
from gpu_worker.pacing import StepClock, lead_fits
from programs.base import LMProgram

FIRST_CHUNK_MODES = ("reference", "adaptive", "fastest")


class AudioWindows:
    def __init__(self, program: LMProgram, first_chunk: str, clock: StepClock) -> None:
        if first_chunk not in FIRST_CHUNK_MODES:
            raise ValueError(f"first_chunk must be reference, adaptive or fastest, not {first_chunk!r}")
        self.program = program
        self.stride = program.detok_interval - program.detok_overlap
        if self.stride <= 0:
            raise ValueError(f"{program.name}: detok_overlap must be smaller than detok_interval")
        self.fastest = first_chunk == "fastest"
        self.leads = () if first_chunk == "reference" else tuple(program.detok_lead)
        self.clock = clock

    def after_row(self, req) -> DetokChunk | None:
        """The window that `req`'s newest audio row (row n - 1 of req.audio) completes, if any.
        Advances req.n_chunks and, after a lead, req.first_window."""
        n, interval = req.n_audio, self.program.detok_interval
        if n >= interval and (n - interval) % self.stride == 0:
            j = (n - interval) // self.stride
            if j < req.first_window:
                return None  # covered by the lead window
            chunk = DetokChunk(req.rid, req.n_chunks, req.sp.seed, req.audio[n - interval : n].tobytes(), j)
        elif req.n_chunks == 0 and n in self.leads and self.lead_now(n):
            chunk = DetokChunk(req.rid, 0, req.sp.seed, req.audio[:n].tobytes(), LEAD_NOISE_BASE + n)
            req.first_window = self.first_window_after(n)
        else:
            return None
        req.n_chunks += 1
        return chunk

    def flush(self, req) -> DetokChunk | None:
        """detok_flush: window j = req.n_chunks holding rows [j*s, n) then pad rows, or None (flush
        off, or nothing left over). Its audio is its last s rows, of which n_rows are real."""
        p = self.program
        if not p.detok_flush:
            return None
        audio, j = req.audio[: req.n_audio], req.n_chunks
        start, end = j * self.stride, j * self.stride + p.detok_interval
        left = len(audio) - (end - self.stride)
        if left <= 0:
            return None
        window = np.concatenate([audio[start:], p.pad_rows(end - len(audio))]).astype("<i4")
        req.n_chunks += 1
        return DetokChunk(req.rid, j, req.sp.seed, window.tobytes(), j, n_rows=left)

    def first_window_after(self, lead_rows: int) -> int:
        """The first regular window whose audio starts at or after the lead's: window j covers
        audio rows from j*s + detok_offset."""
        return max(0, -(-(lead_rows - self.program.detok_offset) // self.stride))

    def lead_now(self, lead_rows: int) -> bool:
        """Send a lead window of `lead_rows` now? Only when the next regular window will arrive
        before the lead's audio has played out, at the rate steps go now."""
        if self.fastest:
            return True
        p, s = self.program, self.stride
        gap = self.first_window_after(lead_rows) * s + p.detok_interval - lead_rows
        lead_audio_s = lead_rows * p.detok_samples / s / p.sample_rate
        return lead_fits(gap, lead_audio_s, self.clock.row_period())
