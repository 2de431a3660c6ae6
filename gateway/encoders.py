"""Audio containers for responses: PCM16 mono in, the bytes of one response format out.

`make_encoder(fmt, sample_rate, streaming)` gives an `Encoder`: `feed(pcm)` returns the bytes that
can be sent now, `finish()` the rest. wav and pcm are framed here; flac, mp3 and opus are encoded by
libsndfile (through soundfile) into a sink that hands out bytes as libsndfile writes them.

What streams (bytes leave as audio comes in) and what does not:
- pcm: raw samples, streams.
- wav: streams with RIFF/data sizes 0xFFFFFFFF ("until the connection ends"), which libsndfile,
  ffmpeg and browsers read; a whole file gets exact sizes.
- mp3: streams. Constant bitrate, so readers that estimate the length from the size (libsndfile's
  mpg123 does) get it right: the Xing/LAME header that a whole file carries is written at the end,
  which a stream cannot go back for, so a streamed file keeps LAME's empty placeholder frame.
- opus (Ogg Opus): streams; Ogg pages are flushed every 50 ms of audio (libsndfile's default is
  1 s), so a page leaves with every chunk.
- flac: never streamed. libsndfile writes the length and MD5 into STREAMINFO at the end, and
  readers, libsndfile itself included, refuse a FLAC whose length is unknown (0), so a FLAC
  response is sent whole when the audio is complete.
- aac: libsndfile has no AAC encoder.
"""

from __future__ import annotations

import functools
import io
from typing import Any

import numpy as np

try:  # libsndfile through cffi; without it only wav and pcm are served (see available_formats)
    import soundfile as sf
except (ImportError, OSError):
    sf = None

from gateway.wav import wav_file, wav_header

# libsndfile's "compression level" for MP3 picks the constant bitrate: 0.4 → 96 kbit/s at 16-24 kHz
# (MPEG-2), 192 kbit/s at 32-48 kHz (MPEG-1). Plenty for speech.
MP3_COMPRESSION = 0.4
OPUS_PAGE_LATENCY_MS = 50.0
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; soundfile does not expose sf_command

_MIME = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_LIBSNDFILE = {  # format → (libsndfile major format, subtype, extra SoundFile arguments)
    "mp3": ("MP3", "MPEG_LAYER_III", {"bitrate_mode": "CONSTANT", "compression_level": MP3_COMPRESSION}),
    "opus": ("OGG", "OPUS", {}),
    "flac": ("FLAC", "PCM_16", {}),
}
_ORDER = ("mp3", "opus", "flac", "wav", "pcm")  # OpenAI's order, less aac


class Encoder:
    """PCM16 mono in, one container's bytes out. The base class is raw PCM."""

    streams = True  # feed() returns bytes as audio comes in (else everything comes from finish())
    threaded = False  # CPU work worth moving off the event loop

    def __init__(self, fmt: str, streaming: bool) -> None:
        self.format = fmt
        self.content_type = _MIME[fmt]
        self.streaming = streaming and self.streams
        self._parts: list[bytes] = []

    def feed(self, pcm: bytes) -> bytes:
        if self.streaming:
            return pcm
        self._parts.append(pcm)
        return b""

    def finish(self) -> bytes:
        return b"" if self.streaming else b"".join(self._parts)

    def close(self) -> None:
        """Release resources without finishing (the response was abandoned)."""


class WavEncoder(Encoder):
    def __init__(self, sample_rate: int, streaming: bool) -> None:
        super().__init__("wav", streaming)
        self.sample_rate = sample_rate
        self._header: bytes = wav_header(sample_rate, None) if self.streaming else b""

    def feed(self, pcm: bytes) -> bytes:
        if not self.streaming:
            return super().feed(pcm)
        out, self._header = self._header + pcm, b""  # the header leaves with the first audio
        return out

    def finish(self) -> bytes:
        if self.streaming:
            out, self._header = self._header, b""
            return out
        return wav_file(self.sample_rate, b"".join(self._parts))


class _Sink:
    """A file object for libsndfile that records what it writes.

    Streaming, `take()` hands out the bytes written since the last call and forgets them; a later
    write behind them (a header libsndfile fills in at the end) is dropped, as it would be on a
    pipe. Whole, the file is kept and `take()` at the end returns all of it."""

    def __init__(self, streaming: bool) -> None:
        self.streaming = streaming
        self._buf = bytearray()
        self._base = 0  # file offset of _buf[0]
        self._pos = 0

    def write(self, data: Any) -> int:
        data = bytes(data)
        start = self._pos - self._base
        self._pos += len(data)
        if start < 0:  # behind what was already sent
            data, start = data[-start:], 0
        end = start + len(data)
        if end > len(self._buf):
            self._buf.extend(bytes(end - len(self._buf)))
        self._buf[start:end] = data
        return end - start

    def take(self) -> bytes:
        out = bytes(self._buf)
        if self.streaming:
            self._base += len(self._buf)
            self._buf = bytearray()
        return out

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        size = self._base + len(self._buf)
        self._pos = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: size + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        start = max(0, self._pos - self._base)
        out = bytes(self._buf[start : None if n < 0 else start + n])
        self._pos += len(out)
        return out


class SoundfileEncoder(Encoder):
    """flac, mp3 and opus through libsndfile."""

    threaded = True  # ~0.1 ms (flac) to ~1 ms (opus) per 2048-sample chunk

    def __init__(self, fmt: str, sample_rate: int, streaming: bool) -> None:
        self.streams = fmt != "flac"
        super().__init__(fmt, streaming)
        major, subtype, extra = _LIBSNDFILE[fmt]
        self._sink = _Sink(self.streaming)
        if sf is None:
            raise RuntimeError(f"{fmt} needs the soundfile package (libsndfile), which is not installed")
        self._file: sf.SoundFile | None = sf.SoundFile(
            self._sink, "w", samplerate=sample_rate, channels=1, format=major, subtype=subtype, **extra
        )
        if fmt == "opus" and self.streaming:
            _set_page_latency(self._file, OPUS_PAGE_LATENCY_MS)

    def feed(self, pcm: bytes) -> bytes:
        assert self._file is not None, "feed after finish"
        self._file.write(np.frombuffer(pcm, dtype="<i2"))
        return self._sink.take() if self.streaming else b""

    def finish(self) -> bytes:
        self.close()
        return self._sink.take()

    def close(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            f.close()


def _set_page_latency(f: sf.SoundFile, ms: float) -> None:
    from soundfile import _ffi, _snd  # soundfile's cffi handles: the only way to reach sf_command

    value = _ffi.new("double*", ms)
    _snd.sf_command(f._file, _SFC_SET_OGG_PAGE_LATENCY_MS, value, _ffi.sizeof("double"))


def make_encoder(fmt: str, sample_rate: int, streaming: bool) -> Encoder:
    """An encoder for one response. `streaming` is a wish: flac never streams (see above)."""
    if fmt == "wav":
        return WavEncoder(sample_rate, streaming)
    if fmt == "pcm":
        return Encoder("pcm", streaming)
    if fmt in _LIBSNDFILE:
        return SoundfileEncoder(fmt, sample_rate, streaming)
    raise ValueError(f"unknown response format {fmt!r}; known: {', '.join(_ORDER)}")


@functools.lru_cache(maxsize=8)
def available_formats(sample_rate: int) -> tuple[str, ...]:
    """The formats this build can encode at `sample_rate`, found by encoding a few samples (a
    libsndfile built without LAME or Opus, or a rate Opus/MPEG lack, drops the format)."""
    out = []
    for fmt in _ORDER:
        if fmt in _LIBSNDFILE:
            try:
                enc = SoundfileEncoder(fmt, sample_rate, streaming=False)
                enc.feed(bytes(2 * 960))
                enc.finish()
            except Exception:
                continue
        out.append(fmt)
    return tuple(out)


def default_format(sample_rate: int) -> str:
    """OpenAI's default, mp3, when this build can encode it; else wav."""
    return "mp3" if "mp3" in available_formats(sample_rate) else "wav"


def content_type(fmt: str) -> str:
    return _MIME[fmt]
