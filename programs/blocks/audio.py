"""Audio front-end pieces the clip encoders share: a windowed-sinc resampler (torchaudio's
`transforms.Resample` arithmetic) and the Slaney mel filterbank (librosa's `filters.mel`)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def resample(
    audio: torch.Tensor,
    source: int,
    target: int,
    zeros: int = 6,
    rolloff: float = 0.99,
    kernel_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """audio [..., S] float at `source` Hz → [..., ceil(S · target / source)] at `target` Hz: each
    output sample a windowed-sinc interpolation of the inputs (Hann window over `zeros` zero
    crossings of a low-pass at `rolloff` of the lower Nyquist rate), as one strided convolution.
    The kernel is computed in `kernel_dtype` (default: the audio's; torchaudio's `Resample` uses
    float64, its phases' offsets in the audio's dtype) and applied in the audio's dtype."""
    if source == target:
        return audio
    g = math.gcd(source, target)
    up, down = target // g, source // g
    cutoff = min(up, down) * rolloff
    width = math.ceil(zeros * down / cutoff)
    dtype, dev = audio.dtype, audio.device
    taps = torch.arange(-width, width + down, dtype=kernel_dtype or dtype, device=dev)[None, None] / down
    t = (torch.arange(0, -up, -1, dtype=dtype, device=dev)[:, None, None] / up + taps) * cutoff
    t = t.clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.ones((), dtype=t.dtype, device=dev), t.sin() / t)
    kernel = (kernel * (window * (cutoff / down))).to(dtype)  # [up, 1, taps]
    flat = audio.reshape(-1, audio.shape[-1])
    out = F.conv1d(F.pad(flat, (width, width + down))[:, None], kernel, stride=down)
    out = out.transpose(1, 2).reshape(flat.shape[0], -1)[:, : math.ceil(up * flat.shape[-1] / down)]
    return out.reshape(*audio.shape[:-1], out.shape[-1])


def mel_filters(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """The Slaney-scale, Slaney-normalized mel filterbank [n_mels, n_fft // 2 + 1] float32 (librosa's
    `filters.mel` defaults), computed in float64."""

    def to_mel(f: np.ndarray) -> np.ndarray:
        log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (math.log(6.4) / 27.0)
        return np.where(f >= 1000.0, log, f / (200.0 / 3))

    def to_hz(m: np.ndarray) -> np.ndarray:
        return np.where(m >= 15.0, 1000.0 * np.exp((math.log(6.4) / 27.0) * (m - 15.0)), m * (200.0 / 3))

    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    edges = to_hz(np.linspace(to_mel(np.array(fmin)), to_mel(np.array(fmax)), n_mels + 2))
    gaps = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    lower = -ramps[:-2] / gaps[:-1, None]
    upper = ramps[2:] / gaps[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)
