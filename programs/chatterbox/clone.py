"""Chatterbox's voice cloning encoders (codec_worker): a 16 kHz clip → T3's conditioning, the voice
encoder's speaker embedding [256] and the S3 tokenizer's prompt speech tokens [<= 150].

Based on chatterbox-tts 0.1.7 (`ChatterboxTTS.prepare_conditionals`, models/voice_encoder,
models/s3tokenizer) and s3tokenizer 0.3's `S3TokenizerV2` (the reference), with their parameter names
(`ve.safetensors`; `s3gen.safetensors` under `tokenizer.`) and arithmetic:

- speaker: the clip trimmed of silence (librosa's `effects.trim`, 20 dB below the loudest 2048-sample
  frame), a 40-band power mel (n_fft 400, hop 160, Slaney), cut into 160-frame windows every 77
  frames (rate 1.3 windows a second, the last one kept when it covers 80 %), each through a 3-layer
  LSTM, projected, ReLU'd and L2-normed; their mean L2-normed;
- prompt tokens: the clip's first 6 s, a 128-band log mel (Whisper's: log10, floor at max - 8,
  (x + 4) / 4) of its first 600 frames, a Whisper-style encoder (two stride-2 convolutions, 6
  blocks of rotary attention with an FSMN memory) and the FSQ quantizer (8 ternary digits: 6561
  tokens, 25 a second).

And S3Gen's conditioning of the same clip (`S3Gen.embed_ref(clip[:10 s], 16000)`; tts.py cuts the
clip to DEC_COND_LEN = 10 s first), `s3gen_voice`:

- prompt mel: the clip resampled to 24 kHz (torchaudio's `transforms.Resample(16000, 24000)`:
  windowed sinc, Hann window over 6 zero crossings of a low-pass at 0.99 of 8 kHz, its kernel
  computed in float64 and kept in float32), reflect-padded by 720 samples on each side, |STFT|
  (n_fft = window 1920, hop 480, not centered; sqrt(re² + im² + 1e-9)) through librosa's Slaney
  mel filters (80 bands, 0-8 kHz) and log(max(·, 1e-5)) (Matcha-TTS's `mel_spectrogram`): 50
  frames a second, two a token;
- prompt tokens: the S3 tokenizer's tokens of the whole clip (<= 250), cut to the mel's frames // 2;
- x-vector: CAM++ of the 16 kHz clip (xvector.py).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks.audio import mel_filters, resample
from programs.chatterbox.xvector import MIN_SAMPLES, CAMPPlus

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160
PROMPT_SAMPLES = 6 * SAMPLE_RATE  # ENC_COND_LEN
PROMPT_TOKENS = 150
TOKEN_SAMPLES = 640  # 25 tokens a second
S3GEN_RATE = 24000
S3GEN_PROMPT_SAMPLES = 10 * SAMPLE_RATE  # DEC_COND_LEN
S3GEN_PROMPT_TOKENS = S3GEN_PROMPT_SAMPLES // TOKEN_SAMPLES  # 250
S3GEN_N_FFT, S3GEN_HOP, S3GEN_MELS = 1920, 480, 80
WINDOW_FRAMES, WINDOW_STEP = 160, 77  # the voice encoder's partials: round(16000 / 1.3 / 160)
TOKENIZER = {"n_mels": 128, "n_state": 1280, "n_head": 20, "n_layer": 6}  # S3TokenizerV2's ModelConfig


def trim_silence(wav: np.ndarray, top_db: float = 20.0, frame: int = 2048, hop: int = 512) -> np.ndarray:
    """The clip without its leading and trailing frames `top_db` below its loudest (librosa's
    `effects.trim`: RMS of zero-padded centered frames, in dB against the maximum)."""
    padded = np.pad(wav, frame // 2)
    n = 1 + (len(padded) - frame) // hop
    frames = np.lib.stride_tricks.as_strided(padded, (n, frame), (padded.strides[0] * hop, padded.strides[0]))
    rms = np.sqrt(np.mean(np.abs(frames) ** 2, axis=-1))
    power = np.square(rms)
    db = 10.0 * np.log10(np.maximum(1e-10, power)) - 10.0 * np.log10(np.maximum(1e-10, power.max()))
    loud = np.flatnonzero(db > -top_db)
    if not loud.size:
        return wav[:0]
    return wav[loud[0] * hop : min(len(wav), (loud[-1] + 1) * hop)]


class VoiceEncoder(nn.Module):
    """The speaker encoder (`ve.safetensors`): `lstm`, `proj`, and the training-only similarity
    parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(40, 256, num_layers=3, batch_first=True)
        self.proj = nn.Linear(256, 256)
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))
        self.register_buffer(
            "basis", torch.from_numpy(mel_filters(SAMPLE_RATE, N_FFT, 40, 0.0, 8000.0)), persistent=False
        )

    @torch.inference_mode()
    def embed(self, wav: np.ndarray) -> np.ndarray:
        """A 16 kHz clip [S] float32 → its speaker embedding [256] float32 (L2-normed)."""
        wav = trim_silence(wav)
        audio = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32)).to(self.basis.device)
        window = torch.hann_window(N_FFT, device=audio.device)
        spec = torch.stft(
            audio, N_FFT, HOP, window=window, center=True, pad_mode="reflect", return_complex=True
        )
        mel = (self.basis @ spec.abs() ** 2).T  # [T, 40]
        n_frames = mel.shape[0]
        n, rest = divmod(max(n_frames - WINDOW_FRAMES + WINDOW_STEP, 0), WINDOW_STEP)
        if n == 0 or (rest + WINDOW_FRAMES - WINDOW_STEP) / WINDOW_FRAMES >= 0.8:
            n += 1
        target = WINDOW_FRAMES + WINDOW_STEP * (n - 1)
        mel = F.pad(mel, (0, 0, 0, max(0, target - n_frames)))[:target]
        partials = mel.unfold(0, WINDOW_FRAMES, WINDOW_STEP).transpose(1, 2)  # [n, 160, 40]
        _, (hidden, _) = self.lstm(partials)
        each = F.relu(self.proj(hidden[-1]))
        each = each / torch.linalg.norm(each, dim=1, keepdim=True)
        mean = each.mean(0)
        return (mean / torch.linalg.norm(mean)).cpu().numpy()


class _Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class _Attention(nn.Module):
    """Rotary multi-head attention plus the FSMN memory (a depthwise convolution over the values)."""

    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query, self.value, self.out = (
            _Linear(n_state, n_state),
            _Linear(n_state, n_state),
            _Linear(n_state, n_state),
        )
        self.key = _Linear(n_state, n_state, bias=False)
        self.fsmn_block = nn.Conv1d(n_state, n_state, 31, groups=n_state, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [1, T, D] (one clip, no padding) → [1, T, D]."""
        b, t, d = x.shape
        scale = (d // self.n_head) ** -0.25
        q, k, v = (p(x).view(b, t, self.n_head, -1) for p in (self.query, self.key, self.value))
        q, k = (
            y * cos + torch.cat((-y[..., y.shape[-1] // 2 :], y[..., : y.shape[-1] // 2]), -1) * sin
            for y in (q, k)
        )
        flat = v.reshape(b, t, d)
        memory = self.fsmn_block(F.pad(flat.transpose(1, 2), (15, 15))).transpose(1, 2) + flat
        q = q.permute(0, 2, 1, 3) * scale
        k = k.permute(0, 2, 3, 1) * scale
        w = torch.softmax((q @ k).float(), dim=-1).to(q.dtype)
        out = (w @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).flatten(2)
        return self.out(out) + memory


class _Block(nn.Module):
    def __init__(self, n_state: int, n_head: int) -> None:
        super().__init__()
        self.attn = _Attention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.mlp = nn.Sequential(_Linear(n_state, 4 * n_state), nn.GELU(), _Linear(4 * n_state, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x.float()).to(x.dtype), cos, sin)
        return x + self.mlp(self.mlp_ln(x.float()).to(x.dtype))


class _Encoder(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        n = cfg["n_state"]
        self.conv1 = nn.Conv1d(cfg["n_mels"], n, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(n, n, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(_Block(n, cfg["n_head"]) for _ in range(cfg["n_layer"]))


class S3Tokenizer(nn.Module):
    """The S3 speech tokenizer v2 (`encoder.*`, `quantizer._codebook.project_down`)."""

    def __init__(self, cfg: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.cfg = dict(cfg or TOKENIZER)
        self.encoder = _Encoder(self.cfg)
        self.quantizer = nn.Module()
        self.quantizer._codebook = nn.Module()
        self.quantizer._codebook.project_down = nn.Linear(self.cfg["n_state"], 8)
        self.register_buffer(
            "basis",
            torch.from_numpy(mel_filters(SAMPLE_RATE, N_FFT, self.cfg["n_mels"], 0.0, 8000.0)),
            persistent=False,
        )
        # Rotary angles of head width 64 for 2048 positions (s3tokenizer's precompute_freqs_cis).
        freqs = 1.0 / (10000.0 ** (torch.arange(0, 64, 2)[:32].float() / 64))
        angles = torch.outer(torch.arange(2048).float(), freqs)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1), persistent=False)

    @torch.inference_mode()
    def tokens(self, wav: np.ndarray, max_tokens: int = PROMPT_TOKENS) -> np.ndarray:
        """A 16 kHz clip [S] float32 → the speech tokens [<= max_tokens] int32 of its first
        `max_tokens` × 40 ms (T3's prompt: 150, the first 6 s; S3Gen's: 250, 10 s)."""
        audio = torch.from_numpy(np.ascontiguousarray(wav[: max_tokens * TOKEN_SAMPLES], dtype=np.float32))
        audio = audio.to(self.basis.device)
        window = torch.hann_window(N_FFT, device=audio.device)
        spec = torch.stft(audio, N_FFT, HOP, window=window, return_complex=True)
        log = torch.clamp(self.basis @ spec[..., :-1].abs() ** 2, min=1e-10).log10()
        mel = ((torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0)[:, : 4 * max_tokens]  # [128, T]
        enc = self.encoder
        x = F.gelu(enc.conv1(mel[None]))
        x = F.gelu(enc.conv2(x)).transpose(1, 2)  # [1, T / 4, D]
        t = x.shape[1]
        cos, sin = self.cos[None, :t, None, :].to(x.dtype), self.sin[None, :t, None, :].to(x.dtype)
        for block in enc.blocks:
            x = block(x, cos, sin)
        h = self.quantizer._codebook.project_down(x[0]).float().tanh()
        digits = (h * 0.9990000128746033).round() + 1  # [T, 8] in {0, 1, 2}
        powers = torch.pow(3, torch.arange(8, device=h.device, dtype=h.dtype))
        return (digits * powers).sum(-1).to(torch.int32).cpu().numpy()


@functools.lru_cache(maxsize=4)
def _s3gen_mel_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    basis = mel_filters(S3GEN_RATE, S3GEN_N_FFT, S3GEN_MELS, 0.0, 8000.0)
    return torch.from_numpy(basis).to(device), torch.hann_window(S3GEN_N_FFT, device=device)


def s3gen_mel(wav: torch.Tensor) -> torch.Tensor:
    """24 kHz audio [S > 720] float32 → S3Gen's prompt mel [S // 480, 80] (chatterbox's
    s3gen/utils/mel.py `mel_spectrogram`), on the audio's device."""
    basis, window = _s3gen_mel_constants(wav.device)
    pad = (S3GEN_N_FFT - S3GEN_HOP) // 2
    audio = F.pad(wav.float()[None, None], (pad, pad), mode="reflect")[0]
    spec = torch.stft(audio, S3GEN_N_FFT, S3GEN_HOP, S3GEN_N_FFT, window, center=False, return_complex=True)
    spec = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)
    return torch.log(torch.clamp(basis @ spec, min=1e-5))[0].T


@torch.inference_mode()
def s3gen_voice(wav: np.ndarray, tokenizer: S3Tokenizer, speaker_encoder: CAMPPlus) -> dict[str, np.ndarray]:
    """A 16 kHz clip [S] float32 → S3Gen's conditioning of its first 10 s (`S3Gen.embed_ref` of
    them at 16 kHz): `s3gen_tokens` int32 [P] (1 <= P <= 250), `s3gen_mel` float32 [2P, 80]
    (frame-major: the reference's `prompt_feat[0]`; where its mel has an odd frame count 2P + 1, a
    clip ending 20-40 ms past a whole token, the last frame is left out) and `s3gen_xvector`
    float32 [192]. Computed on the tokenizer's and the speaker encoder's devices. ValueError for a
    clip under 45 ms (CAM++'s deviation over time needs two frames after its stride: the
    reference's x-vector is NaN there)."""
    wav = np.ascontiguousarray(wav[:S3GEN_PROMPT_SAMPLES], dtype=np.float32)
    if len(wav) < MIN_SAMPLES:
        raise ValueError(f"the reference clip is too short for S3Gen's voice ({MIN_SAMPLES / 16:g} ms)")
    audio = torch.from_numpy(wav).to(speaker_encoder.banks.device)
    mel = s3gen_mel(resample(audio, SAMPLE_RATE, S3GEN_RATE, kernel_dtype=torch.float64))  # as Resample
    tokens = tokenizer.tokens(wav, S3GEN_PROMPT_TOKENS)
    p = min(len(tokens), len(mel) // 2)
    return {
        "s3gen_tokens": tokens[:p],
        "s3gen_mel": mel[: 2 * p].float().cpu().numpy(),
        "s3gen_xvector": speaker_encoder.embed(audio).float().cpu().numpy(),
    }
