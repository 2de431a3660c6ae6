"""S3Gen's speaker encoder (codec_worker): a 16 kHz clip → its CAM++ x-vector [192], S3Gen's
`embedding` of a cloned voice.

Based on chatterbox-tts 0.1.7's models/s3gen/xvector.py (`CAMPPlus.inference`, from 3D-Speaker via
FunASR) with its parameter names (`s3gen.safetensors` under `speaker_encoder.`) and arithmetic, and
on torchaudio's `compliance.kaldi.fbank` as the reference calls it (`num_mel_bins=80`, the other
options at their defaults):

- features: Kaldi filterbanks of the clip as it is (no scaling to 16-bit): frames of 400 samples
  every 160 that fit in the clip (snip_edges), each less its mean (remove_dc_offset), pre-emphasized
  (0.97, the first sample against itself), under a Povey window (the symmetric Hann to the power
  0.85), zero-padded to 512, the power spectrum through 80 triangles evenly spaced on Kaldi's mel
  scale (1127 ln(1 + f / 700)) from 20 Hz to 8 kHz, the log of each floored at float32's epsilon;
  no dither, no energy column. The features less their mean over the clip;
- network: the FCM head (a 2-D convolution and two stages of residual blocks, stride 2 along
  frequency: 80 bands → 10 × 32 channels), a TDNN layer (kernel 5, stride 2 in time), three densely
  connected CAM blocks (12, 24 and 16 layers of growth 32, each a bottleneck and a dilated
  convolution gated by a context of the clip's mean and its 100-frame segment means) with transition
  layers halving the channels, the mean and the unbiased standard deviation over time, a dense layer
  to 192 and a batch norm without affine parameters. Every batch norm uses its running statistics.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

SAMPLE_RATE = 16000
FRAME, SHIFT, PADDED = 400, 160, 512  # 25 ms every 10 ms, the FFT at the next power of two
MEL_BINS, LOW_HZ = 80, 20.0
PREEMPHASIS, POVEY = 0.97, 0.85
EMBEDDING = 192
MIN_SAMPLES = FRAME + 2 * SHIFT  # three frames: the TDNN's stride-2 output has two, a finite deviation


def kaldi_mel_banks(bins: int = MEL_BINS, low: float = LOW_HZ, high: float = SAMPLE_RATE / 2) -> torch.Tensor:
    """Kaldi's mel filterbank [bins, PADDED // 2 + 1] float32 (torchaudio's `get_mel_banks` without
    VTLN, in its float32 arithmetic, the Nyquist column zero)."""

    def mel(f: float) -> float:
        return 1127.0 * math.log(1.0 + f / 700.0)

    lo, hi = mel(low), mel(high)
    delta = (hi - lo) / (bins + 1)
    b = torch.arange(bins).unsqueeze(1)
    left, center, right = lo + b * delta, lo + (b + 1.0) * delta, lo + (b + 2.0) * delta
    freqs = (SAMPLE_RATE / PADDED) * torch.arange(float(PADDED // 2))
    m = (1127.0 * (1.0 + freqs / 700.0).log()).unsqueeze(0)
    up, down = (m - left) / (center - left), (right - m) / (right - center)
    return F.pad(torch.max(torch.zeros(1), torch.min(up, down)), (0, 1))


def kaldi_fbank(wav: torch.Tensor, banks: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """A 16 kHz clip [S >= 400] float32 → its log filterbank energies [1 + (S - 400) // 160, bins]
    (`torchaudio.compliance.kaldi.fbank` with its defaults but the bins)."""
    frames = wav.unfold(0, FRAME, SHIFT)  # [m, 400]
    frames = frames - frames.mean(1, keepdim=True)
    frames = frames - PREEMPHASIS * torch.cat([frames[:, :1], frames[:, :-1]], 1)
    frames = F.pad(frames * window, (0, PADDED - FRAME))
    power = torch.fft.rfft(frames).abs().pow(2.0)
    eps = torch.tensor(torch.finfo(torch.float32).eps, dtype=power.dtype, device=power.device)
    return torch.max(torch.mm(power, banks.T), eps).log()


class _Norm(nn.BatchNorm2d):
    """A batch norm (1-D or 2-D: the same parameters) that always uses its running statistics."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
        )


def _nonlinear(channels: int, affine: bool = True) -> nn.Sequential:
    """The reference's `get_nonlinear` container (`…nonlinear.batchnorm.*`); the ReLU is applied by
    the caller."""
    return nn.Sequential(OrderedDict(batchnorm=_Norm(channels, affine=affine)))


class _ResBlock(nn.Module):
    """FCM's BasicResBlock: two 3×3 convolutions (the first of stride `stride` along frequency)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=(stride, 1), padding=1, bias=False)
        self.bn1 = _Norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = _Norm(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=(stride, 1), bias=False), _Norm(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.shortcut(x))


class _FCM(nn.Module):
    def __init__(self, channels: int = 32, feat_dim: int = MEL_BINS) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, stride=1, padding=1, bias=False)
        self.bn1 = _Norm(channels)
        self.layer1 = nn.Sequential(_ResBlock(channels, channels, 2), _ResBlock(channels, channels, 1))
        self.layer2 = nn.Sequential(_ResBlock(channels, channels, 2), _ResBlock(channels, channels, 1))
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=(2, 1), padding=1, bias=False)
        self.bn2 = _Norm(channels)
        self.out_channels = channels * (feat_dim // 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F, T] → [B, 32 F / 8, T]."""
        out = F.relu(self.bn1(self.conv1(x[:, None])))
        out = self.layer2(self.layer1(out))
        out = F.relu(self.bn2(self.conv2(out)))
        return out.flatten(1, 2)


class _TDNN(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(c_in, c_out, 5, stride=2, padding=2, bias=False)
        self.nonlinear = _nonlinear(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.nonlinear(self.linear(x)))


class _CAMLayer(nn.Module):
    def __init__(self, c_bn: int, c_out: int, dilation: int) -> None:
        super().__init__()
        self.linear_local = nn.Conv1d(c_bn, c_out, 3, padding=dilation, dilation=dilation, bias=False)
        self.linear1 = nn.Conv1d(c_bn, c_bn // 2, 1)
        self.linear2 = nn.Conv1d(c_bn // 2, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_local(x)
        t = x.shape[-1]
        seg = F.avg_pool1d(x, kernel_size=100, stride=100, ceil_mode=True)  # 100-frame segment means
        seg = seg.unsqueeze(-1).expand(*seg.shape, 100).reshape(*seg.shape[:-1], -1)[..., :t]
        context = F.relu(self.linear1(x.mean(-1, keepdim=True) + seg))
        return y * torch.sigmoid(self.linear2(context))


class _DenseLayer(nn.Module):
    """CAMDenseTDNNLayer: batch norm, ReLU, 1×1 bottleneck, batch norm, ReLU, the CAM layer."""

    def __init__(self, c_in: int, c_out: int, c_bn: int, dilation: int) -> None:
        super().__init__()
        self.nonlinear1 = _nonlinear(c_in)
        self.linear1 = nn.Conv1d(c_in, c_bn, 1, bias=False)
        self.nonlinear2 = _nonlinear(c_bn)
        self.cam_layer = _CAMLayer(c_bn, c_out, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(F.relu(self.nonlinear1(x)))
        return self.cam_layer(F.relu(self.nonlinear2(x)))


class _Block(nn.ModuleDict):
    """CAMDenseTDNNBlock (`tdnnd1`, `tdnnd2`, …): each layer's output joins its input."""

    def __init__(self, layers: int, c_in: int, growth: int, c_bn: int, dilation: int) -> None:
        super().__init__(
            {f"tdnnd{i + 1}": _DenseLayer(c_in + i * growth, growth, c_bn, dilation) for i in range(layers)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = torch.cat([x, layer(x)], dim=1)
        return x


class _Transit(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.nonlinear = _nonlinear(c_in)
        self.linear = nn.Conv1d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(F.relu(self.nonlinear(x)))


class _Dense(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.linear = nn.Conv1d(c_in, c_out, 1, bias=False)
        self.nonlinear = _nonlinear(c_out, affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C] → [B, EMBEDDING] (batch norm, no ReLU)."""
        return self.nonlinear(self.linear(x[..., None])[..., 0])


class _XVector(nn.Module):
    """The reference's `xvector` Sequential: tdnn, block1, transit1, …, out_nonlinear, dense."""

    def __init__(self, channels: int, init: int = 128, growth: int = 32, bn_size: int = 4) -> None:
        super().__init__()
        self.tdnn = _TDNN(channels, init)
        channels = init
        for i, (layers, dilation) in enumerate(((12, 1), (24, 2), (16, 2))):
            self.add_module(f"block{i + 1}", _Block(layers, channels, growth, bn_size * growth, dilation))
            channels += layers * growth
            self.add_module(f"transit{i + 1}", _Transit(channels, channels // 2))
            channels //= 2
        self.out_nonlinear = _nonlinear(channels)
        self.dense = _Dense(2 * channels, EMBEDDING)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tdnn(x)
        for i in (1, 2, 3):
            x = getattr(self, f"transit{i}")(getattr(self, f"block{i}")(x))
        x = F.relu(self.out_nonlinear(x))
        stats = torch.cat([x.mean(dim=-1), x.std(dim=-1, unbiased=True)], dim=-1)
        return self.dense(stats)


class CAMPPlus(nn.Module):
    """The CAM++ speaker encoder (`head.*`, `xvector.*`: s3gen.safetensors' `speaker_encoder.*`)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = _FCM()
        self.xvector = _XVector(self.head.out_channels)
        self.register_buffer("banks", kaldi_mel_banks(), persistent=False)
        self.register_buffer("window", torch.hann_window(FRAME, periodic=False).pow(POVEY), persistent=False)

    def features(self, wav: torch.Tensor) -> torch.Tensor:
        """A 16 kHz clip [S >= 400] float32 → its mean-normalized Kaldi filterbanks [T, 80]."""
        feat = kaldi_fbank(wav.to(self.banks), self.banks, self.window)
        return feat - feat.mean(dim=0, keepdim=True)

    @torch.inference_mode()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """A 16 kHz clip [S >= MIN_SAMPLES] float32 (any device) → its x-vector [192] float32 on the
        module's device (`CAMPPlus.inference` of a batch of one)."""
        if wav.shape[-1] < MIN_SAMPLES:
            raise ValueError(f"an x-vector needs {MIN_SAMPLES} samples ({MIN_SAMPLES / 16:g} ms) at least")
        x = self.features(wav)[None].transpose(1, 2)  # [1, 80, T]
        return self.xvector(self.head(x))[0]


def random_init(model: CAMPPlus, seed: int) -> CAMPPlus:
    """Seeded random weights whose activations stay of order one (for `--load-format dummy` and the
    tests): convolution kernels N(0, 2 / fan_in), their biases N(0, 0.1²); batch norms' scales
    1 + N(0, 0.1²), shifts and running means N(0, 0.1²), running variances in [0.5, 1.5]."""
    gen = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(mean + std * torch.randn(t.shape, generator=gen))

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, _Norm):
                if module.affine:
                    normal(module.weight, 1.0, 0.1)
                    normal(module.bias, 0.0, 0.1)
                normal(module.running_mean, 0.0, 0.1)
                module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=gen))
            elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
                normal(module.weight, 0.0, math.sqrt(2.0 / module.weight[0].numel()))
                if module.bias is not None:
                    normal(module.bias, 0.0, 0.1)
    return model


def speaker_encoder(s3gen: dict[str, torch.Tensor] | None = None, seed: int = 2) -> CAMPPlus:
    """CAMPPlus (eval, on the CPU) with the `speaker_encoder.*` weights of `s3gen` (the state dict of
    `s3gen.safetensors`; the batch norms' `num_batches_tracked`, which inference never reads, may
    be missing), or with `random_init`'s weights of `seed` where it is None."""
    model = CAMPPlus()
    if s3gen is None:
        return random_init(model, seed).eval()
    prefix = "speaker_encoder."
    weights = {k[len(prefix) :]: v for k, v in s3gen.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise KeyError(f"speaker_encoder weights: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()
