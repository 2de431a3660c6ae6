"""Voice cloning in the benchmarks: reference clips made here, a saved voice, and cloned requests.

A cloned request carries a NEW clip each time (a seeded chirp under noise, a few seconds of 24 kHz
PCM16 WAV, from a counter and a nonce of this process), so the server's clip cache (keyed by the
clip's content) misses every time and each one pays its clip's decoding and encoding. It is a
multipart `POST /generate` (the clip as the file `audio`, its `ref_text`, the other fields as
strings): the same endpoint and the same WAV stream as the plain requests of `bench.load`, so the
two are timed alike. A saved voice is uploaded once (`POST /v1/audio/voices`) and then named by
`voice`: the plain requests of a model without preset voices (a Base model clones or speaks a
saved voice) use one.

`Cloning` says which requests of a load level clone (`share` of the closed loop's clients, or of
the open loop's requests); `split` reports a level's cloned and plain requests apart, so the cost
of cloning to the others can be read against a level run with share 0.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import itertools
import random
import uuid
import wave
from collections.abc import Callable

import aiohttp
import numpy as np

RATE = 24000
REF_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
PLAIN_VOICE = "bench-plain"  # the saved voice of a model without preset voices' plain requests


def clip_wav(seed: int, seconds: float = 3.0, rate: int = RATE) -> bytes:
    """A clip no other seed gives: a voiced chirp (its pitch, sweep and harmonics from `seed`) under
    seeded noise, as PCM16 mono WAV bytes ([seconds * rate] samples)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = rng.uniform(90, 260) * (1 + rng.uniform(-0.3, 0.3) * t / seconds)  # Hz, sweeping
    phase = 2 * np.pi * np.cumsum(f0) / rate
    wave_ = sum(rng.uniform(0.05, 0.3) / k * np.sin(k * phase) for k in range(1, 6))
    wave_ = wave_ * (0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(2, 5) * t)) + 0.02 * rng.standard_normal(
        len(t)
    )
    pcm = (np.clip(wave_, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def data_url(wav: bytes) -> str:
    """`ref_audio`'s data-URL form of a WAV file (as vLLM-Omni clients send it)."""
    return "data:audio/wav;base64," + base64.b64encode(wav).decode()


def clone_form(body: dict, wav: bytes, ref_text: str = REF_TEXT) -> aiohttp.FormData:
    """A /generate request cloning `wav`: `body`'s fields as strings, `ref_text` and the file `audio`."""
    form = aiohttp.FormData()
    for name, value in body.items():
        form.add_field(name, str(value).lower() if isinstance(value, bool) else str(value))
    form.add_field("ref_text", ref_text)
    form.add_field("audio", wav, filename="clip.wav", content_type="audio/wav")
    return form


async def save_voice(session: aiohttp.ClientSession, base: str, name: str, wav: bytes) -> dict:
    """Save `wav` as voice `name` (`POST /v1/audio/voices`), replacing one of that name; its card."""
    async with session.delete(f"{base}/v1/audio/voices/{name}"):
        pass  # absent (404) or deleted: either way the name is free
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("ref_text", REF_TEXT)
    form.add_field("audio", wav, filename=f"{name}.wav", content_type="audio/wav")
    async with session.post(base + "/v1/audio/voices", data=form) as r:
        if r.status != 201:
            raise RuntimeError(f"saving voice {name}: HTTP {r.status}: {(await r.text())[:300]}")
        return await r.json()


async def plain_voice(session: aiohttp.ClientSession, base: str, card: dict, seconds: float = 3.0) -> str:
    """The voice of plain requests: none (the model's own voice) unless the model speaks only in a
    cloned voice (`voice_required`), then a voice saved here (`PLAIN_VOICE`, from a clip of
    `seconds`)."""
    if not card.get("voice_required"):
        return ""
    await save_voice(session, base, PLAIN_VOICE, clip_wav(0, seconds))
    return PLAIN_VOICE


@dataclasses.dataclass
class Cloning:
    """Which requests of a load level clone, and how: `share` of the closed loop's clients (the
    first share × concurrency, rounded half up) or of the open loop's requests send a new clip each request of
    `seconds`; the others are plain (with `voice` when set)."""

    share: float = 0.0
    voice: str = ""
    seconds: float = 3.0
    nonce: int = dataclasses.field(default_factory=lambda: uuid.uuid4().int & 0xFFFFFFFF)
    _count: itertools.count = dataclasses.field(default_factory=itertools.count)

    def client_clones(self, client: int, concurrency: int) -> bool:
        return client < int(self.share * concurrency + 0.5)  # half up: 0.25 of 2 clients is one

    def request_clones(self, rng: random.Random) -> bool:
        return self.share > 0 and rng.random() < self.share

    def request(self, body: dict, cloned: bool) -> dict | aiohttp.FormData:
        """The request for `body`: a form with a new clip when `cloned`, else `body` (its voice set)."""
        if cloned:
            return clone_form(body, clip_wav(self.nonce * 1_000_003 + next(self._count), self.seconds))
        return {**body, "voice": self.voice} if self.voice else body


# Of a level's summary (bench.load.summarize), what `split` keeps for each kind of request.
KEPT = (
    "requests", "errors", "error_examples", "rejected", "ttfa_p50_ms", "ttfa_p90_ms", "ttfa_p99_ms",
    "on_time_share", "x_realtime_per_stream_p50", "x_realtime_per_stream_min", "late_requests",
)  # fmt: skip


def split(cloning: Cloning, results: list, summarize: Callable[[list], dict]) -> dict:
    """{"clone_share", "cloned": …, "plain": …}: a level's requests (bench.load.Result) of each kind
    summarized apart by `summarize` (bench.load.summarize of the level), `KEPT` of each."""
    out: dict = {"clone_share": cloning.share}
    for kind, cloned in (("cloned", True), ("plain", False)):
        summary = summarize([r for r in results if r.cloned == cloned])
        out[kind] = {k: None if summary[k] != summary[k] else summary[k] for k in KEPT}  # NaN: none
        if not summary["requests"]:
            out[kind]["on_time_share"] = None  # no request, no share of them
    return out
