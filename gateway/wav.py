"""WAV framing for PCM16 mono audio, the format every voxpipe response carries.

A streaming response does not know its length when the header goes out, so it uses the
convention most decoders (ffmpeg, browsers, soundfile in streaming mode) accept: RIFF and data
sizes of 0xFFFFFFFF, meaning "read until the connection ends".
"""

from __future__ import annotations

import struct

HEADER_BYTES = 44
SAMPLE_WIDTH = 2  # bytes per PCM16 sample
UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF/data size of a stream whose length is not known yet


def wav_header(sample_rate: int, n_samples: int | None) -> bytes:
    """The 44-byte canonical header of a PCM16 mono WAV; `n_samples=None` → streaming sizes."""
    if n_samples is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = n_samples * SAMPLE_WIDTH
        if data_size + HEADER_BYTES - 8 > UNKNOWN_SIZE:
            raise ValueError(f"{n_samples} samples do not fit in one WAV file (4 GiB limit)")
        riff_size = data_size + HEADER_BYTES - 8  # everything after the "RIFF<size>" preamble
    channels = 1
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        riff_size,
        b"WAVE",
        b"fmt ",
        16,  # fmt chunk size for PCM
        1,  # format tag: integer PCM
        channels,
        sample_rate,
        sample_rate * channels * SAMPLE_WIDTH,  # byte rate
        channels * SAMPLE_WIDTH,  # block align
        SAMPLE_WIDTH * 8,  # bits per sample
        b"data",
        data_size,
    )


def wav_file(sample_rate: int, pcm: bytes) -> bytes:
    """A complete WAV file around int16 little-endian mono samples."""
    n_samples = len(pcm) // SAMPLE_WIDTH
    return wav_header(sample_rate, n_samples) + pcm[: n_samples * SAMPLE_WIDTH]
