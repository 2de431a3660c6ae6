"""Long text: splitting it into segments one generation can speak, and joining their audio.

A generation has a token budget (the model's max_tokens, prompt included) that must hold the prompt
and every audio token of the speech. Longer input is
cut at sentence ends into segments, generated one after another as separate requests (so a long
text holds one slot at a time), and streamed in order.

The segment size rule (`segment_budget`, sizes in UTF-8 bytes, which bound the prompt's token count
for byte-level tokenizers such as Llama 3's):

    budget = floor((max_tokens - prompt_overhead) / (1 + rows_per_second / SLOW_SPEECH_BYTES_PER_S))

i.e. each byte costs at most one prompt token plus the audio tokens of slow speech (10 bytes/s;
people speak 12-16); `prompt_overhead` and `rows_per_second` come from the model's spec (the
program computes them). A model of 82.03 rows/s with 12 rows of overhead and 1200 tokens: 129
bytes per segment (~9 s of speech). A text longer than the budget is cut into n = ceil(len / budget) segments of
about len / n bytes each (even sizes, not a full budget then a scrap): sentences are packed while
that brings a segment closer to len / n, a sentence longer than the budget is cut at clause
punctuation, then between words, then between characters.

At each join the last FADE_S of a segment fades out and the first FADE_S of the next fades in
(raised cosine), so a join has no step and no click while the total length stays the sum of the
segments. The gateway holds back those last samples until it knows the segment has ended.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from common.config import ServeConfig
from common.messages import ModelSpec

# --max-text-chars may not exceed this: about an hour of speech in one HTTP response.
MAX_TEXT_CHARS_LIMIT = 50_000
SLOW_SPEECH_BYTES_PER_S = 10.0
FADE_S = 0.010

# A sentence ends after . ! ? … (and closing quotes/brackets) before whitespace, after CJK full
# stops, or at a line break.
_CLOSE = "[\"'”’»)\\]]"  # closing quotes and brackets that may follow the full stop
SENTENCE_END = re.compile(
    rf"(?:(?<=[.!?…])|(?<=[.!?…]{_CLOSE})|(?<=[.!?…]{_CLOSE}{{2}}))\s+|(?<=[。！？])\s*|\n\s*"
)
CLAUSE_END = re.compile(r"(?<=[,;:—–])\s+|(?<=[，；：、])\s*")
_SPACE = re.compile(r"\s+")
_LEVELS = [SENTENCE_END, CLAUSE_END, _SPACE]  # then between characters


def text_limit(cfg: ServeConfig) -> int:
    """The longest accepted input in characters: --max-text-chars, capped at MAX_TEXT_CHARS_LIMIT."""
    return max(1, min(cfg.gateway.max_text_chars, MAX_TEXT_CHARS_LIMIT))


def segment_budget(spec: ModelSpec, max_tokens: int) -> int:
    """The most UTF-8 bytes of text one generation of `max_tokens` can surely speak (see above)."""
    per_byte = 1.0 + spec.rows_per_second / SLOW_SPEECH_BYTES_PER_S
    return max(1, math.floor((max_tokens - spec.prompt_overhead) / per_byte))


def split_text(text: str, budget: int) -> list[str]:
    """`text` as segments of at most `budget` UTF-8 bytes, cut at sentence ends where possible and
    of even size (see the module docstring). Segments are slices of `text`: only the whitespace at
    the cuts is dropped."""
    return [text[lo:hi] for lo, hi in _split(text, 0, len(text), budget, 0)]


def _split(text: str, lo: int, hi: int, budget: int, level: int) -> list[tuple[int, int]]:
    """Segments of text[lo:hi] as (start, end): cut at separator `level`; runs of pieces that fit
    are packed together, a piece that does not is split at the next level on its own."""
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    if lo == hi:
        return []
    if _size(text[lo:hi]) <= budget:
        return [(lo, hi)]
    if level == len(_LEVELS):
        return _hard_cut(text, lo, hi, budget)
    out: list[tuple[int, int]] = []
    run: list[tuple[int, int]] = []
    for piece in _cut(text, lo, hi, _LEVELS[level]):
        if _size(text[piece[0] : piece[1]]) <= budget:
            run.append(piece)
            continue
        out += _pack(text, run, budget) + _split(text, *piece, budget, level + 1)
        run = []
    return out + _pack(text, run, budget)


def _cut(text: str, lo: int, hi: int, separator: re.Pattern[str]) -> list[tuple[int, int]]:
    """text[lo:hi] cut at every match of `separator`, blank pieces dropped."""
    out, start = [], lo
    for m in separator.finditer(text, lo, hi):
        out.append((start, m.start()))
        start = max(start, m.end())
    out.append((start, hi))
    return [(a, b) for a, b in out if text[a:b].strip()]


def _pack(text: str, pieces: list[tuple[int, int]], budget: int) -> list[tuple[int, int]]:
    """Consecutive pieces (each within budget) joined into segments of about even size: a piece
    joins the current segment while that brings the segment closer to the target size."""
    if not pieces:
        return []
    total = _size(text[pieces[0][0] : pieces[-1][1]])
    target = total / math.ceil(total / budget)
    out = []
    start, end = pieces[0]
    for lo, hi in pieces[1:]:
        size = _size(text[start:hi])
        if size > budget or abs(size - target) >= abs(_size(text[start:end]) - target):
            out.append((start, end))
            start = lo
        end = hi
    return [*out, (start, end)]


def _hard_cut(text: str, lo: int, hi: int, budget: int) -> list[tuple[int, int]]:
    """Cut between characters (text without spaces, e.g. CJK) into about even pieces of at most
    `budget` bytes (or one character, if a character is larger)."""
    ends = np.cumsum([len(ch.encode("utf-8")) for ch in text[lo:hi]])  # byte offset after each char
    target = ends[-1] / math.ceil(ends[-1] / budget)
    out, start, done = [], lo, 0  # `done`: bytes before `start`
    while ends[-1] - done > budget:
        # the last character boundary within budget, or the one nearest the even split if sooner
        fits = int(np.searchsorted(ends, done + budget, side="right"))
        near = int(np.argmin(np.abs(ends[:fits] - (done + target)))) + 1 if fits else 1
        cut = max(1, min(fits, near))
        out.append((start, lo + cut))
        start, done = lo + cut, int(ends[cut - 1])
        ends, lo = ends[cut:], lo + cut
    return [*out, (start, hi)]


def _size(text: str) -> int:
    return len(text.encode("utf-8"))


@functools.lru_cache(maxsize=8)
def _ramp(fade: int) -> np.ndarray:
    """The fade-in ramp of `fade` samples (a raised cosine), computed once per length: a Joiner is
    made for every request."""
    ramp = 0.5 - 0.5 * np.cos(np.pi * (np.arange(fade) + 0.5) / fade) if fade else np.zeros(0)
    ramp.flags.writeable = False
    return ramp


class Joiner:
    """Joins the PCM16 streams of consecutive segments without a click.

    `start(last)` opens a segment; `feed` returns what can be sent now; `end()` returns the rest.
    The first `fade` samples of every segment but the first fade in; the last `fade` samples of
    every segment but the last are held back until `end()` and fade out. A single segment passes
    through untouched.
    """

    def __init__(self, fade: int) -> None:
        self.fade = fade
        self._ramp = _ramp(fade)
        self._index = -1
        self._last = True
        self._pos = 0  # samples of this segment seen so far
        self._held = np.zeros(0, dtype="<i2")

    def start(self, last: bool) -> None:
        self._index += 1
        self._last = last
        self._pos = 0
        self._held = np.zeros(0, dtype="<i2")

    def feed(self, pcm: bytes) -> bytes:
        x = np.frombuffer(pcm, dtype="<i2")
        if self._index > 0 and self._pos < self.fade:  # fade in the head of a later segment
            n = min(self.fade - self._pos, len(x))
            x = x.copy()
            x[:n] = np.round(x[:n] * self._ramp[self._pos : self._pos + n]).astype("<i2")
        self._pos += len(x)
        if self._last:
            return x.tobytes()
        x = np.concatenate([self._held, x])
        cut = max(0, len(x) - self.fade)
        self._held = x[cut:]
        return x[:cut].tobytes()

    def end(self) -> bytes:
        """The held tail, faded out (nothing for the last segment: it holds nothing back)."""
        tail, self._held = self._held, np.zeros(0, dtype="<i2")
        if not len(tail):
            return b""
        ramp = self._ramp[::-1][self.fade - len(tail) :]  # the end of the fade-out curve
        return np.round(tail * ramp).astype("<i2").tobytes()
