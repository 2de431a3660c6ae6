"""A stream's edges for codecs that must decode every row (programs/base.py, "Stream edges"): the
last window of a request whose final rows fill no whole window, padded past the end."""

from __future__ import annotations

import numpy as np

from common.messages import DetokChunk
from programs.base import LMProgram


def flush_window(program: LMProgram, rid: str, seed: int, audio: np.ndarray, j: int) -> DetokChunk | None:
    """audio [n, C]: the request's audio rows (preseed included); j: its next regular window.
    → window j holding rows [j*s, n) then pad rows, or None (flush off, or nothing left over)."""
    if not program.detok_flush:
        return None
    s = program.detok_interval - program.detok_overlap
    start, end = j * s, j * s + program.detok_interval  # window j; its audio is its last s rows
    left = len(audio) - (end - s)
    if left <= 0:
        return None
    window = np.concatenate([audio[start:], program.pad_rows(end - len(audio))]).astype("<i4")
    return DetokChunk(rid, j, seed, window.tobytes(), j, n_rows=left)
