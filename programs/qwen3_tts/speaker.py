"""Qwen3-TTS Base's speaker encoder: 24 kHz audio → log-mel features → ECAPA-TDNN x-vector [enc_dim].

Based on qwen-tts' `Qwen3TTSSpeakerEncoder` and `mel_spectrogram` (qwen_tts/core/models/
modeling_qwen3_tts.py, the reference), under its parameter names (`speaker_encoder.*` of a Base
checkpoint), with ECAPA-TDNN (Desplanques et al. 2020):

- features: the waveform reflect-padded by (n_fft - hop) / 2 on both sides, a Hann STFT (n_fft
  1024, hop 256, no centering), magnitudes sqrt(re² + im² + 1e-9), a Slaney mel filterbank
  (librosa's `filters.mel`: 128 bands, 0-12 kHz, Slaney-normalized), log(max(x, 1e-5)): a clip
  of S samples gives S // 256 frames;
- network: a TDNN (conv + ReLU, "same" reflect padding), three SE-Res2Net blocks (TDNN 1×1,
  Res2Net of `scale` dilated TDNNs, TDNN 1×1, squeeze-excitation on the time mean, residual), the
  multi-layer aggregation TDNN over the three blocks' outputs, attentive statistics pooling (the
  global mean and std as context, attention over time, the weighted mean and std) and a 1×1 conv.

Batching: clips of different lengths ride in one padded batch and each gets its embedding alone:
every "same" padding reflects at the clip's own ends (gathered per clip), and every mean, std and
softmax over time counts the clip's frames only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks.audio import mel_filters

N_FFT, HOP, N_MELS, F_MAX = 1024, 256, 128, 12000
DEFAULTS = {
    "mel_dim": N_MELS,
    "enc_dim": 1024,
    "enc_channels": [512, 512, 512, 512, 1536],
    "enc_kernel_sizes": [5, 3, 3, 3, 1],
    "enc_dilations": [1, 2, 3, 4, 1],
    "enc_attention_channels": 128,
    "enc_res2net_scale": 8,
    "enc_se_channels": 128,
    "sample_rate": 24000,
}  # the reference's `Qwen3TTSSpeakerEncoderConfig` defaults, which a checkpoint's config overrides


def _reflect(x: torch.Tensor, lengths: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """x [B, C, L] (clip b valid to lengths[b]) → [B, C, L + left + right]: each clip reflect-padded
    at its own ends (positions past a clip's padded end repeat its last sample: never read)."""
    pos = torch.arange(-left, x.shape[-1] + right, device=x.device)[None, :]  # [1, L']
    last = (lengths[:, None] - 1).clamp(min=0)
    idx = torch.where(pos < 0, -pos, pos)
    idx = torch.where(idx > last, 2 * last - idx, idx).clamp(min=0)
    idx = torch.minimum(idx, last)
    return torch.gather(x, 2, idx[:, None, :].expand(x.shape[0], x.shape[1], -1))


def log_mel(
    audio: torch.Tensor, lengths: torch.Tensor, basis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """audio [B, S] float32 at 24 kHz, lengths [B] → log-mel [B, n_mels, T] and frames [B] (S // hop)."""
    pad = (N_FFT - HOP) // 2
    y = _reflect(audio[:, None, :], lengths, pad, pad)[:, 0]
    window = torch.hann_window(N_FFT, device=audio.device)
    spec = torch.stft(y, N_FFT, HOP, N_FFT, window, center=False, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, F, T]
    mel = torch.log(torch.clamp(basis @ mag, min=1e-5))
    return mel, torch.div(lengths, HOP, rounding_mode="floor")


class Tdnn(nn.Module):
    """Conv1d with "same" reflect padding at each clip's ends, then ReLU (`conv`)."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation)
        total = dilation * (kernel - 1)
        self.pad = (total // 2, total - total // 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.pad != (0, 0):
            x = _reflect(x, lengths, *self.pad)
        return F.relu(self.conv(x))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], mask [B, 1, T] float (1 valid) → [B, C, 1] the mean over each clip's frames."""
    return (x * mask).sum(2, keepdim=True) / mask.sum(2, keepdim=True)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, se: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(channels, se, 1)
        self.conv2 = nn.Conv1d(se, channels, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.conv2(F.relu(self.conv1(_masked_mean(x, mask)))))
        return x * gate


class Res2Net(nn.Module):
    """Channels in `scale` groups: group 0 as is, group i>0 through TDNN i-1 (after adding group
    i-1's output from i=2 on)."""

    def __init__(self, channels: int, scale: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(Tdnn(width, width, kernel, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        parts = list(torch.chunk(x, self.scale, dim=1))
        out = [parts[0]]
        for i in range(1, self.scale):
            inp = parts[i] if i == 1 else parts[i] + out[-1]
            out.append(self.blocks[i - 1](inp, lengths))
        return torch.cat(out, dim=1)


class SeRes2NetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, scale: int, se: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = Tdnn(cin, cout, 1, 1)
        self.res2net_block = Res2Net(cout, scale, kernel, dilation)
        self.tdnn2 = Tdnn(cout, cout, 1, 1)
        self.se_block = SqueezeExcitation(cout, se)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tdnn2(self.res2net_block(self.tdnn1(x, lengths), lengths), lengths)
        return self.se_block(h, mask) + x


class AttentiveStatsPooling(nn.Module):
    """Attention over time with the clip's global mean and std as context → [mean; std] [B, 2C, 1]."""

    def __init__(self, channels: int, attention: int) -> None:
        super().__init__()
        self.tdnn = Tdnn(channels * 3, attention, 1, 1)
        self.conv = nn.Conv1d(attention, channels, 1)

    @staticmethod
    def _stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = (w * x).sum(2)
        std = torch.sqrt((w * (x - mean[:, :, None]).pow(2)).sum(2).clamp(min=1e-12))
        return mean, std

    def forward(self, x: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = x.shape[-1]
        mean, std = self._stats(x, mask / mask.sum(2, keepdim=True))
        context = torch.cat([x, mean[:, :, None].expand(-1, -1, t), std[:, :, None].expand(-1, -1, t)], dim=1)
        scores = self.conv(torch.tanh(self.tdnn(context, lengths)))
        attn = torch.softmax(scores.masked_fill(mask == 0, float("-inf")), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat([mean, std], dim=1)[:, :, None]


class SpeakerEncoder(nn.Module):
    """The ECAPA-TDNN speaker encoder from a checkpoint's `speaker_encoder_config` (the reference's
    defaults filled in); its `state_dict` names equal the checkpoint's under `speaker_encoder.`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        cfg = {**DEFAULTS, **cfg}
        ch, ks, ds = cfg["enc_channels"], cfg["enc_kernel_sizes"], cfg["enc_dilations"]
        if not len(ch) == len(ks) == len(ds):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations differ in length")
        self.sample_rate = cfg["sample_rate"]
        self.dim = cfg["enc_dim"]
        blocks: list[nn.Module] = [Tdnn(cfg["mel_dim"], ch[0], ks[0], ds[0])]
        scale, se = cfg["enc_res2net_scale"], cfg["enc_se_channels"]
        blocks += [SeRes2NetBlock(ch[i - 1], ch[i], scale, se, ks[i], ds[i]) for i in range(1, len(ch) - 1)]
        self.blocks = nn.ModuleList(blocks)
        self.mfa = Tdnn(ch[-1], ch[-1], ks[-1], ds[-1])
        self.asp = AttentiveStatsPooling(ch[-1], cfg["enc_attention_channels"])
        self.fc = nn.Conv1d(ch[-1] * 2, cfg["enc_dim"], 1)
        basis = mel_filters(self.sample_rate, N_FFT, cfg["mel_dim"], 0.0, F_MAX)
        self.register_buffer("mel_basis", torch.from_numpy(basis), persistent=False)

    def features(self, mel: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """log-mel [B, n_mels, T] with each clip's frames [B] (at least 1) → x-vectors [B, enc_dim]."""
        mask = (torch.arange(mel.shape[-1], device=mel.device)[None, :] < frames[:, None]).to(mel.dtype)
        mask = mask[:, None, :]  # [B, 1, T]
        x = self.blocks[0](mel, frames)
        outs = []
        for block in self.blocks[1:]:
            x = block(x, frames, mask)
            outs.append(x)
        x = self.mfa(torch.cat(outs, dim=1), frames)
        return self.fc(self.asp(x, frames, mask))[:, :, 0]

    @torch.no_grad()
    def embed(self, audio: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """audio [B, S] float32 at `sample_rate` padded clips, lengths [B] samples (at least one
        hop, 256) → x-vectors [B, enc_dim] float32."""
        if len(lengths) and int(lengths.min()) < HOP:
            raise ValueError(f"the speaker encoder needs clips of at least {HOP} samples")
        dev = self.mel_basis.device
        mel, frames = log_mel(audio.to(dev, torch.float32), lengths.to(dev), self.mel_basis)
        return self.features(mel.to(self.fc.weight.dtype), frames).float()

    def load_weights(self, weights) -> set[str]:
        """(name, tensor) pairs of a Base checkpoint: its `speaker_encoder.*` (others passed over)."""
        from programs.blocks.weights import copy_weights

        mine = (
            (n.removeprefix("speaker_encoder."), t) for n, t in weights if n.startswith("speaker_encoder.")
        )
        return copy_weights(self, mine, skip=lambda n: False)
