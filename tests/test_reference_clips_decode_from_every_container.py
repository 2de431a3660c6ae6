"""A reference clip in any container libsndfile reads (WAV, FLAC, OGG Vorbis, MP3), at any rate and
channel count, becomes the same mono float32 at the model's rate (gateway.clips): the mix of its
channels, resampled, as long as the clip, and keyed by its samples."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from gateway.clips import ClipLimits, clip_bytes, decode_clip
from gateway.fields import BadRequest

LIMITS = ClipLimits(10 << 20, 30.0)
SECONDS = 0.8


def source(rate: int) -> np.ndarray:
    """[S, 2]: a 300 Hz tone, louder on the left, with a slow swell (a clip with a voice's range)."""
    t = np.arange(int(rate * SECONDS)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 300 * t) * (0.7 + 0.3 * np.sin(2 * np.pi * 2 * t))
    return np.stack([tone, 0.5 * tone], axis=1).astype(np.float32)


def encoded(fmt: str, rate: int) -> bytes:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile has no {fmt}")
    buf = io.BytesIO()
    sf.write(buf, source(rate), rate, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(("fmt", "rate"), [("WAV", 16000), ("FLAC", 44100), ("OGG", 48000), ("MP3", 44100)])
def test_every_container_decodes_to_the_mono_mix_at_the_models_rate(fmt: str, rate: int) -> None:
    clip = decode_clip(encoded(fmt, rate), 24000, LIMITS)
    assert clip.audio.dtype == np.float32 and clip.audio.ndim == 1
    assert abs(len(clip.audio) - 24000 * SECONDS) <= 0.06 * 24000  # lossy codecs pad a little
    want = source(24000).mean(axis=1)  # the mix, as if recorded at 24 kHz
    n = min(len(want), len(clip.audio)) - 2400
    # Lossy encoders delay the audio: compare at the best lag within 60 ms.
    best = max(
        np.corrcoef(clip.audio[lag : lag + n], want[:n])[0, 1] for lag in range(0, len(clip.audio) - n, 24)
    )
    assert best > 0.95, f"{fmt}: the decoded clip is not the source ({best:.3f})"
    assert 0.3 < np.abs(clip.audio).max() < 0.9


def test_the_same_samples_have_the_same_key_whatever_the_wrapping() -> None:
    wav = encoded("WAV", 24000)
    a = decode_clip(wav, 24000, LIMITS)
    b = decode_clip(
        clip_bytes("data:audio/wav;base64," + base64.b64encode(wav).decode(), LIMITS), 24000, LIMITS
    )
    c = decode_clip(clip_bytes(base64.urlsafe_b64encode(wav).decode().rstrip("="), LIMITS), 24000, LIMITS)
    assert a.key == b.key == c.key and np.array_equal(a.audio, b.audio)
    resampled = decode_clip(encoded("WAV", 16000), 24000, LIMITS)  # the same tone, other samples
    assert resampled.key != a.key


def test_a_clip_over_the_limits_is_refused_before_it_is_decoded() -> None:
    wav = encoded("WAV", 16000)
    with pytest.raises(BadRequest, match="larger than 1000 bytes"):
        decode_clip(wav, 24000, ClipLimits(1000, 30.0))
    with pytest.raises(BadRequest, match="larger than 1000 bytes"):
        clip_bytes(base64.b64encode(wav).decode(), ClipLimits(1000, 30.0))
    with pytest.raises(BadRequest, match="0.8 s long; the limit is 0.5 s"):
        decode_clip(wav, 24000, ClipLimits(1 << 20, 0.5))
