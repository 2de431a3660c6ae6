"""S3Gen's vocoder: HiFT, 80-band mel [B, 80, F] at 50 Hz → 24 kHz audio [B, 480 F].

Based on chatterbox-tts 0.1.7's `HiFTGenerator` and `ConvRNNF0Predictor` (models/s3gen/hifigan.py,
f0_predictor.py, the reference), with their parameter names (`s3gen.safetensors` under `mel2wav.`,
weight norms folded into plain weights when loading) and arithmetic:

- an F0 predictor (5 convolutions with ELU, a linear layer, |·|) gives a pitch per frame, repeated
  480 times; a neural source filter makes 9 harmonics of it (sines of the running phase, random
  starting phases but the fundamental's, noise where unvoiced), mixed by a linear layer and tanh;
- the mel goes through a convolution, 3 transposed-convolution upsamplings (8, 5, 3) each with the
  source's 16-point STFT downsampled to its rate added and 3 Snake residual stacks averaged, and a
  convolution to 9 log-magnitudes and 9 phases, which an inverse STFT (hop 4) turns into audio,
  clamped to ±0.99.

The random numbers (harmonic phases [B, 9], source noise [B, 9, 480 F]) are inputs, so the caller
decides where they come from (programs/chatterbox/codec.py: the request's seed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SINE_AMP, NOISE_STD, VOICED = 0.1, 0.003, 10.0  # nsf_alpha, nsf_sigma, nsf_voiced_threshold


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    a = alpha[None, :, None]
    return x + (1.0 / (a + 1e-9)) * torch.sin(x * a).pow(2)


class ResBlock(nn.Module):
    """Snake, dilated convolution, Snake, convolution, residual; once per dilation."""

    def __init__(self, ch: int, kernel: int, dilations: list[int]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(ch, ch, kernel, dilation=d, padding=(kernel * d - d) // 2) for d in dilations
        )
        self.convs2 = nn.ModuleList(nn.Conv1d(ch, ch, kernel, padding=(kernel - 1) // 2) for _ in dilations)
        self.activations1 = nn.ModuleList(_Alpha(ch) for _ in dilations)
        self.activations2 = nn.ModuleList(_Alpha(ch) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c1, c2, a1, a2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = x + c2(snake(c1(snake(x, a1.alpha)), a2.alpha))
        return x


class _Alpha(nn.Module):
    """A Snake activation's per-channel frequency (`activations*.i.alpha`)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(ch))


class F0Predictor(nn.Module):
    def __init__(self, mels: int, ch: int) -> None:
        super().__init__()
        convs = [nn.Conv1d(mels if i == 0 else ch, ch, 3, padding=1) for i in range(5)]
        self.condnet = nn.ModuleList(m for conv in convs for m in (conv, nn.ELU()))
        self.classifier = nn.Linear(ch, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, F] → F0 [B, F] (Hz)."""
        x = mel
        for layer in self.condnet:
            x = layer(x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs()


class Source(nn.Module):
    """The harmonic source (`m_source`): its linear mix of the harmonics (`l_linear`)."""

    def __init__(self, harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(harmonics + 1, 1)


class HiFT(nn.Module):
    """Mel → audio (`mel2wav.` in s3gen.safetensors)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        base, ups, kernels = cfg["base_channels"], cfg["upsample_rates"], cfg["upsample_kernels"]
        self.rate, self.harmonics = cfg["sample_rate"], cfg["harmonics"]
        self.n_fft, self.hop = cfg["n_fft"], cfg["hop"]
        self.upsample = self.hop
        for u in ups:
            self.upsample *= u
        self.f0_predictor = F0Predictor(cfg["mels"], cfg["f0_channels"])
        self.m_source = Source(self.harmonics)
        self.conv_pre = nn.Conv1d(cfg["mels"], base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(ups, kernels, strict=True))
        )
        bins = self.n_fft + 2
        downs = [1] + ups[::-1][:-1]
        cum = [1]
        for d in downs[1:]:
            cum.append(cum[-1] * d)
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (u, k, d) in enumerate(
            zip(cum[::-1], cfg["source_kernels"], cfg["source_dilations"], strict=True)
        ):
            ch = base // 2 ** (i + 1)
            down = nn.Conv1d(bins, ch, 1) if u == 1 else nn.Conv1d(bins, ch, u * 2, u, padding=u // 2)
            self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(ch, k, d))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, d)
            for i in range(len(ups))
            for k, d in zip(cfg["resblock_kernels"], cfg["resblock_dilations"], strict=True)
        )
        self.n_kernels = len(cfg["resblock_kernels"])
        self.conv_post = nn.Conv1d(base // 2 ** len(ups), bins, 7, padding=3)
        n = torch.arange(self.n_fft, dtype=torch.float64)
        window = (0.5 - 0.5 * torch.cos(2 * torch.pi * n / self.n_fft)).float()  # periodic Hann
        self.register_buffer("window", window, persistent=False)

    def source(self, f0: torch.Tensor, phases: torch.Tensor, noise: torch.Tensor, theta0=None, at=None):
        """F0 [B, F], phases [B, H] (the fundamental's 0), noise [B, H, S] standard normal → the
        excitation [B, 1, S] (S = 480 F) and the running phase in cycles [B, H, S]. A stream's
        window passes `theta0` [B, H], the running phase before sample `at` [B] int64 (else it is
        0 before sample 0)."""
        dtype = f0.dtype  # the running phase in float32 whatever the codec's precision
        f0, phases, noise = f0.float(), phases.float(), noise.float()
        f0 = f0.repeat_interleave(self.upsample, dim=1)[:, None]  # [B, 1, S]
        k = torch.arange(1, self.harmonics + 2, device=f0.device, dtype=f0.dtype)[None, :, None]
        cycles = torch.cumsum(f0 * k / self.rate, dim=-1)
        if theta0 is not None:
            idx = (at - 1).clamp(min=0)[:, None, None].expand(-1, cycles.shape[1], 1)
            before = cycles.gather(2, idx) * (at > 0)[:, None, None]
            cycles = theta0.float()[..., None] + (cycles - before)
        theta = 2 * torch.pi * (cycles % 1)
        sines = SINE_AMP * torch.sin(theta + phases[..., None])
        uv = (f0 > VOICED).to(f0.dtype)
        amp = uv * NOISE_STD + (1 - uv) * SINE_AMP / 3
        sines = sines * uv + amp * noise
        mixed = self.m_source.l_linear(sines.transpose(1, 2).to(dtype))
        return torch.tanh(mixed).transpose(1, 2), cycles

    def forward(self, mel: torch.Tensor, phases: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, F], phases [B, 9], noise [B, 9, 480 F] → audio [B, 480 F] in [-0.99, 0.99]."""
        return self.decode(mel, self.source(self.f0_predictor(mel), phases, noise)[0])

    def stream(self, mel, phases, noise, theta0: torch.Tensor, at: torch.Tensor, frames: int):
        """A stream's window: mel [B, 80, F] whose `frames` new frames start at sample `at` [B],
        theta0 [B, 9] the running phase before them → audio [B, 480 F], the running phase after
        the new frames [B, 9] (cycles mod 1)."""
        s, cycles = self.source(self.f0_predictor(mel), phases, noise, theta0, at)
        end = (at + frames * self.upsample - 1)[:, None, None].expand(-1, cycles.shape[1], 1)
        return self.decode(mel, s), cycles.gather(2, end)[..., 0] % 1

    def decode(self, mel: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, F], excitation [B, 1, 480 F] → audio [B, 480 F]."""
        spec = torch.stft(
            s[:, 0].float(), self.n_fft, self.hop, self.n_fft, window=self.window, return_complex=True
        )
        s_stft = torch.cat([spec.real, spec.imag], dim=1).to(mel.dtype)
        x = self.conv_pre(mel)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            blocks = self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]
            xs = blocks[0](x)
            for block in blocks[1:]:
                xs = xs + block(x)
            x = xs / self.n_kernels
        x = self.conv_post(F.leaky_relu(x))
        half = self.n_fft // 2 + 1
        mag, phase = torch.exp(x[:, :half]).clamp(max=1e2), torch.sin(x[:, half:])
        mag, phase = mag.float(), phase.float()
        return self.istft(mag * torch.cos(phase), mag * torch.sin(phase)).clamp(-0.99, 0.99).to(mel.dtype)

    def istft(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """torch.istft (centered, Hann window) of [B, n_fft / 2 + 1, F] → [B, hop (F - 1)], written
        out (inverse FFTs, windowed overlap-add, the window's squared envelope divided out) so that
        it holds no host-side check and can be captured in a CUDA graph."""
        frames = torch.fft.irfft(torch.complex(real, imag), n=self.n_fft, dim=1) * self.window[:, None]
        n = frames.shape[-1]
        length = self.hop * (n - 1) + self.n_fft
        fold = dict(output_size=(1, length), kernel_size=(1, self.n_fft), stride=(1, self.hop))
        audio = F.fold(frames, **fold)[:, 0, 0]
        square = self.window.pow(2)[None, :, None].expand(1, -1, n)
        envelope = F.fold(square, **fold)[:, 0, 0]
        half = self.n_fft // 2
        return audio[:, half : length - half] / envelope[:, half : length - half]
