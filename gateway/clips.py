"""Reference clips a request carries: bytes of an audio file → float32 mono at the model's rate.

A clip arrives as a multipart file (`/generate`, `/v1/audio/voices`) or as `ref_audio` on
`/v1/audio/speech`: base64 of the file, or a `data:` URL holding it (vLLM-Omni's form). It is
decoded with libsndfile (soundfile: wav, flac, ogg/vorbis/opus, mp3 where the library has it),
mixed down to mono, and resampled with soxr to the model's `reference_sample_rate`. Decoding and
resampling run in a small thread pool (libsndfile and soxr release the GIL), never on the event
loop, and the pool is bounded so a burst of uploads cannot take every core from the streams.

Every problem is a `BadRequest` that says what to change: bytes that are no audio, a clip over the
size or duration limits (--max-reference-bytes, --max-reference-seconds), a clip that is empty or
silent.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import hashlib
import io

import numpy as np

from gateway.fields import BadRequest

# Decoding threads: a clip of 30 s takes a few ms to decode and resample; two threads keep a burst
# of uploads from holding more than two cores at once.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="clip")
MIN_SECONDS = 0.1  # shorter than this is no voice to clone
SILENT_PEAK = 1e-3  # a clip whose loudest sample is below this (-60 dBFS) is silent


@dataclasses.dataclass(frozen=True)
class ClipLimits:
    """What a clip may be: its file's bytes and its duration."""

    max_bytes: int
    max_seconds: float


@dataclasses.dataclass(frozen=True)
class Clip:
    """A decoded clip: mono float32 samples at the model's reference rate, and their hash."""

    audio: np.ndarray  # [S] float32 in [-1, 1]
    key: str  # sha256 hex of the samples' bytes: the same sound, the same key

    @property
    def nbytes(self) -> int:
        return self.audio.nbytes


def clip_bytes(value: str, limits: ClipLimits, field: str = "ref_audio") -> bytes:
    """The file bytes of a `ref_audio` value: base64, or a data URL (`data:audio/wav;base64,…`)."""
    text = value.strip()
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest(
                f"field {field!r} is a data URL without base64 data; send data:audio/wav;base64,<base64>",
                param=field,
            )
    elif text.startswith(("http://", "https://", "file:")):
        raise BadRequest(
            f"field {field!r} must hold the audio itself (base64 or a data URL); this server fetches no URL",
            param=field,
        )
    if len(text) > 4 * (limits.max_bytes + 2) // 3 + 4:
        raise _too_big(field, limits)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        try:  # the URL-safe alphabet, as some clients send it
            data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        except (binascii.Error, ValueError):
            raise BadRequest(
                f"field {field!r} is not base64 audio (nor a data URL holding it)", param=field
            ) from None
    if len(data) > limits.max_bytes:
        raise _too_big(field, limits)
    return data


def _too_big(field: str, limits: ClipLimits) -> BadRequest:
    return BadRequest(
        f"field {field!r}: the reference clip is larger than {limits.max_bytes} bytes "
        "(--max-reference-bytes); send a shorter clip",
        param=field,
        code="request_too_large",
    )


async def read_clip(data: bytes, rate: int, limits: ClipLimits, field: str = "audio") -> Clip:
    """Decode `data` off the event loop → a Clip at `rate` Hz. Raises BadRequest."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, decode_clip, data, rate, limits, field)


def decode_clip(data: bytes, rate: int, limits: ClipLimits, field: str = "audio") -> Clip:
    """`data` (an audio file) → mono float32 at `rate` Hz, checked against `limits`."""
    import soundfile as sf  # the gateway's encoders need it too; imported where it is used
    import soxr

    if not data:
        raise BadRequest(f"field {field!r}: the reference clip is empty", param=field)
    if len(data) > limits.max_bytes:
        raise _too_big(field, limits)
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            seconds = f.frames / f.samplerate if f.samplerate > 0 else 0.0
            if seconds > limits.max_seconds:
                raise BadRequest(
                    f"field {field!r}: the reference clip is {seconds:.1f} s long; the limit is "
                    f"{limits.max_seconds:g} s (--max-reference-seconds); send a shorter clip",
                    param=field,
                )
            source_rate = f.samplerate
            audio = f.read(dtype="float32", always_2d=True)  # [S, channels]
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as e:
        if isinstance(e, BadRequest):
            raise
        raise BadRequest(
            f"field {field!r} is not audio this server can decode (wav, flac, ogg, mp3): {e}", param=field
        ) from None
    mono = audio.mean(axis=1) if audio.shape[1] > 1 else audio[:, 0]
    if len(mono) < MIN_SECONDS * source_rate:
        raise BadRequest(
            f"field {field!r}: the reference clip is empty or shorter than {MIN_SECONDS:g} s", param=field
        )
    if not np.isfinite(mono).all() or float(np.abs(mono).max()) < SILENT_PEAK:
        raise BadRequest(
            f"field {field!r}: the reference clip is silent; send a recording of the voice", param=field
        )
    if source_rate != rate:
        mono = soxr.resample(mono, source_rate, rate, quality="HQ")
    mono = np.ascontiguousarray(np.clip(mono, -1.0, 1.0), dtype=np.float32)
    return Clip(mono, hashlib.sha256(mono.tobytes()).hexdigest())
