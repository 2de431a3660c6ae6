"""S3Gen, Chatterbox's codec stage (codec_worker): S3 speech tokens → 24 kHz audio, as streams.

`S3Gen` holds the flow (flow.py: tokens → mel) and HiFT (hift.py: mel → audio) with the default
voice's conditioning (the prompt's tokens, its 24 kHz mel and the CAMPPlus x-vector: the checkpoint's
`conds.pt`, or a seeded random voice). `decode` is the reference's whole-utterance inference
(`S3Token2Wav.inference`); `decode_stream` decodes a window of R new tokens per codec slot.

Randomness comes from the request's key (programs/blocks/rng.py), a pure function of the position it
lands on: the flow's starting noise per (frame, channel) of the utterance (the prompt's frames
first), HiFT's harmonic phases per request and its source noise per (harmonic, sample). So a seed
fixes the audio in any batch, and the same noise drives `decode` and the streams.

Streams. S3Gen's attentions see the whole utterance (the encoder's and the estimator's, in the
reference as here), so no window can give the audio the whole utterance's decode gives its frames
before the later tokens exist. A window decodes the prompt and the last `flow_context` tokens of
its request so far (its own R among them) as the reference decodes a whole utterance of those
tokens, and keeps the mel of its R tokens; HiFT runs on those 2R frames after `hift_context`
frames before them (from the same pass), its source's phase carried in the slot from the last
window, and the window returns the audio of its 2R frames. Per slot: the request's tokens so far,
its count, its key and the source's phase. The gap to `decode` of the whole utterance comes from
the tokens a window does not see yet (docs/models/chatterbox.md gives it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks import rng
from programs.chatterbox.flow import Flow
from programs.chatterbox.hift import HiFT

SAMPLES_PER_FRAME = 480  # 24 kHz at 50 mel frames a second
FADE = 480  # the reference's trim_fade: 20 ms of silence, then a 20 ms raised-cosine fade-in
FLOW_NOISE, PHASE_NOISE, SOURCE_NOISE = 1, 2, 3  # salts of the request key
SAMPLE_COUNTER = 1 << 32  # source noise counter: harmonic * SAMPLE_COUNTER + sample
# A weight norm's (g, v) names in a checkpoint: torch's parametrizations, or the older hooks.
WEIGHT_NORMS = (
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)


def window_room(cfg: dict[str, Any]) -> int:
    """The most tokens one stream window of an S3Gen config may hold in any voice: the flow's
    context left next to the longest voice's prompt (`voice_tokens`), less the tokens of HiFT's
    `hift_context` frames before the window (a continuing window's look-back must fall on the
    request's own frames)."""
    ctx, p = cfg["flow_context"], cfg["prompt_tokens"]
    return min(ctx, p + ctx - cfg.get("voice_tokens", p)) - -(-cfg["hift_context"] // 2)


def normal_at(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Standard normal numbers, one per counter: keys [B] int64, counters [B, ...] int64 (Box-Muller
    of two counter-based uniforms)."""
    k = keys.reshape(keys.shape + (1,) * (counters.dim() - 1))
    u1, u2 = rng.uniform(k, 2 * counters), rng.uniform(k, 2 * counters + 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)


def flow_noise(keys: torch.Tensor, frames: torch.Tensor, mels: int) -> torch.Tensor:
    """The flow's starting noise at utterance frames [B, F] int64 → [B, mels, F]."""
    ch = torch.arange(mels, device=frames.device)[None, :, None]
    return normal_at(rng.mix_keys(keys, FLOW_NOISE), frames[:, None, :] * mels + ch)


def source_phases(keys: torch.Tensor, harmonics: int) -> torch.Tensor:
    """HiFT's starting phases [B, harmonics + 1], uniform in [-π, π), the fundamental's 0."""
    h = torch.arange(harmonics + 1, device=keys.device)[None, :]
    u = rng.uniform(rng.mix_keys(keys, PHASE_NOISE)[:, None], h)
    return torch.where(h == 0, 0.0, -torch.pi + u * (2 * torch.pi))


def source_noise(keys: torch.Tensor, samples: torch.Tensor, harmonics: int) -> torch.Tensor:
    """HiFT's source noise at utterance samples [B, S] int64 → [B, harmonics + 1, S]."""
    h = torch.arange(harmonics + 1, device=samples.device)[None, :, None]
    return normal_at(rng.mix_keys(keys, SOURCE_NOISE), h * SAMPLE_COUNTER + samples[:, None, :])


def fade_in(device: torch.device) -> torch.Tensor:
    """The reference's trim_fade [2 FADE]: zeros, then (cos(π → 0) + 1) / 2."""
    ramp = (torch.cos(torch.linspace(torch.pi, 0, FADE, device=device)) + 1) / 2
    return torch.cat([torch.zeros(FADE, device=device), ramp])


class S3Gen(nn.Module):
    """The flow and HiFT (`flow.`, `mel2wav.`) and the default voice's conditioning buffers."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.mels = cfg["flow"]["mels"]
        self.flow = Flow(cfg["flow"])
        self.mel2wav = HiFT({**cfg["hift"], "mels": self.mels})
        self.harmonics = cfg["hift"]["harmonics"]
        self.flow_context, self.hift_context = cfg["flow_context"], cfg["hift_context"]
        p = cfg["prompt_tokens"]
        # A window's flow input: a voice's prompt tokens, then the request's latest tokens (at most
        # flow_context of them), in `positions` places; a cloned voice brings up to voice_tokens.
        self.voice_tokens = cfg.get("voice_tokens", p)
        self.positions = p + self.flow_context
        self.register_buffer("prompt_tokens", torch.zeros(p, dtype=torch.int64), persistent=False)
        self.register_buffer("prompt_mel", torch.zeros(self.mels, 2 * p), persistent=False)
        self.register_buffer("xvector", torch.zeros(cfg["flow"]["xvector_dim"]), persistent=False)

    @property
    def window_limit(self) -> int:
        """The most tokens one stream window may hold in any voice (`window_room`)."""
        return window_room(self.cfg)

    def set_voice(self, tokens: torch.Tensor, mel: torch.Tensor, xvector: torch.Tensor) -> None:
        """The default voice: prompt tokens [P] int64, their mel [80, 2P], x-vector [192]."""
        self.prompt_tokens = tokens.to(self.prompt_tokens.device, torch.int64)
        self.prompt_mel = mel.to(self.prompt_mel)
        self.xvector = xvector.to(self.xvector)

    # --- whole utterances ------------------------------------------------------------------------
    @torch.no_grad()
    def decode(
        self, tokens: torch.Tensor, key: int, voice: tuple[torch.Tensor, ...] | None = None
    ) -> torch.Tensor:
        """One utterance's tokens [T] int64 → audio [480 · 2T] float (S3Token2Wav.inference), in
        `voice` (prompt tokens [P], their mel [80, 2P], x-vector [192]) or the default voice."""
        prompt, prompt_mel, xvector = voice or (self.prompt_tokens, self.prompt_mel, self.xvector)
        dev, p = tokens.device, len(prompt)
        keys = torch.tensor([key], dtype=torch.int64, device=dev)
        ids = torch.cat([prompt.to(dev, torch.int64), tokens])[None]
        frames = torch.arange(2 * ids.shape[1], device=dev)[None]
        noise = flow_noise(keys, frames, self.mels).to(self.prompt_mel.dtype)
        valid = torch.ones_like(ids, dtype=torch.bool)
        cond = F.pad(prompt_mel.to(self.prompt_mel), (0, 2 * len(tokens)))[None]
        mel = self.flow(ids, valid, cond, xvector.to(self.xvector)[None], noise)[:, :, 2 * p :]
        samples = torch.arange(mel.shape[-1] * SAMPLES_PER_FRAME, device=dev)[None]
        phases = source_phases(keys, self.harmonics).to(mel.dtype)
        audio = self.mel2wav(mel, phases, source_noise(keys, samples, self.harmonics).to(mel.dtype))[0]
        fade = fade_in(dev).to(audio.dtype)
        return torch.cat([audio[: len(fade)] * fade[: len(audio)], audio[len(fade) :]])

    # --- streams (graph) ---------------------------------------------------------------------------
    def init_streams(self, n_slots: int) -> None:
        """Per-slot state: the request's last `flow_context` tokens (a ring), their count, its key,
        HiFT's running source phase, and the voice it speaks in (prompt tokens, their count and mel,
        the x-vector: the default voice until `set_stream_voice`)."""
        dev, v = self.prompt_mel.device, self.voice_tokens
        self.s_tokens = torch.zeros(n_slots, self.flow_context, dtype=torch.int64, device=dev)
        self.s_count = torch.zeros(n_slots, dtype=torch.int64, device=dev)
        self.s_key = torch.zeros(n_slots, dtype=torch.int64, device=dev)
        self.s_phase = torch.zeros(n_slots, self.harmonics + 1, dtype=torch.float32, device=dev)
        self.s_prompt = torch.zeros(n_slots, v, dtype=torch.int64, device=dev)
        self.s_prompt_len = torch.zeros(n_slots, dtype=torch.int64, device=dev)
        self.s_prompt_mel = torch.zeros(n_slots, self.mels, 2 * v, dtype=self.prompt_mel.dtype, device=dev)
        self.s_xvector = torch.zeros(n_slots, len(self.xvector), dtype=self.xvector.dtype, device=dev)
        for slot in range(n_slots):
            self.set_stream_voice(slot, None)

    def set_stream_voice(self, slot: int, voice: tuple[torch.Tensor, ...] | None) -> None:
        """Slot `slot` speaks in `voice` (prompt tokens [P] with 1 <= P <= voice_tokens, their mel
        [80, 2P], x-vector [192]) or, with None, the default voice. In place (graph-safe)."""
        tokens, mel, xvector = voice or (self.prompt_tokens, self.prompt_mel, self.xvector)
        p = len(tokens)
        if not 1 <= p <= self.voice_tokens or mel.shape != (self.mels, 2 * p):
            raise ValueError(
                f"a voice is 1 to {self.voice_tokens} prompt tokens and their mel [{self.mels}, 2P]; "
                f"got {p} tokens and a mel of {list(mel.shape)}"
            )
        self.s_prompt[slot].zero_()
        self.s_prompt[slot, :p] = tokens
        self.s_prompt_len[slot] = p
        self.s_prompt_mel[slot].zero_()
        self.s_prompt_mel[slot, :, : 2 * p] = mel
        self.s_xvector[slot] = xvector

    def _context(self, slot: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each entry's flow input, right-aligned in `positions` places: padding, its voice's P
        prompt tokens, its last n tokens (n = min(count, flow_context, positions - P)) → ids, valid,
        each position's first utterance frame, and whether it holds a request token, all [B, L]."""
        ctx, dev = self.flow_context, slot.device
        p = self.s_prompt_len[slot][:, None]  # [B, 1]
        n = torch.minimum(count.clamp(max=ctx)[:, None], self.positions - p)
        rel = torch.arange(self.positions, device=dev)[None] - (self.positions - p - n)  # in [prompt, tokens]
        is_prompt, is_token = (rel >= 0) & (rel < p), rel >= p
        tok = (count[:, None] - n + rel - p).clamp(min=0)  # the request token's index
        hist = self.s_tokens[slot].gather(1, tok % ctx)
        prompt = self.s_prompt[slot].gather(1, rel.clamp(0, self.voice_tokens - 1))
        ids = torch.where(is_token, hist, prompt * is_prompt)
        frame = torch.where(is_token, 2 * (p + tok), 2 * rel.clamp(min=0))
        return ids, is_prompt | is_token, frame, is_token

    def decode_stream(
        self, tokens: torch.Tensor, keys: torch.Tensor, slot: torch.Tensor, fresh: torch.Tensor
    ) -> torch.Tensor:
        """tokens [B, R] continuing each entry's stream in `slot` [B] (`fresh`: it starts, with the
        key `keys` [B]) → the audio of the R tokens [B, 960 R]."""
        b, r = tokens.shape
        if r > self.window_limit:
            raise ValueError(f"a window of {r} tokens exceeds the flow's room of {self.window_limit}")
        dev, h = tokens.device, self.hift_context
        start = torch.where(fresh, 0, self.s_count[slot])  # the request's tokens before this window
        key = torch.where(fresh, keys, self.s_key[slot])
        theta0 = torch.where(fresh[:, None], 0.0, self.s_phase[slot])
        at = (start[:, None] + torch.arange(r, device=dev)) % self.flow_context
        self.s_tokens[slot] = self.s_tokens[slot].scatter(1, at, tokens)
        count = start + r
        ids, valid, frame, is_token = self._context(slot, count)
        frames = (frame[:, :, None] + torch.arange(2, device=dev)).reshape(b, -1)  # [B, 2(P + L)]
        noise = flow_noise(key, frames, self.mels).to(self.prompt_mel.dtype)
        prompt_frame = (valid & ~is_token).repeat_interleave(2, dim=1)[:, None]  # [B, 1, 2(P + L)]
        idx = frames.clamp(max=2 * self.voice_tokens - 1)[:, None].expand(-1, self.mels, -1)
        cond = self.s_prompt_mel[slot].gather(2, idx) * prompt_frame
        mel = self.flow(ids, valid, cond, self.s_xvector[slot], noise)
        # HiFT: the window's 2R frames after hift_context frames of the request before them; a
        # first window's frames start HiFT's input, as the utterance's start does in `decode`.
        n, f = (2 * r + h) * SAMPLES_PER_FRAME, 2 * r + h
        keep = is_token.repeat_interleave(2, dim=1)[:, None, -f:]
        shift = torch.where(fresh, h, 0)  # frames the input moves left
        idx = (torch.arange(f, device=dev) + shift[:, None])[:, None].expand(-1, self.mels, -1)
        mel = F.pad(mel[:, :, -f:] * keep, (0, h)).gather(2, idx)
        first = (2 * start - h + shift) * SAMPLES_PER_FRAME  # the utterance sample HiFT's input starts at
        samples = first[:, None] + torch.arange(n, device=dev)
        phases = source_phases(key, self.harmonics).to(mel.dtype)
        snoise = source_noise(key, samples.clamp(min=0), self.harmonics).to(mel.dtype)
        at = (h - shift) * SAMPLES_PER_FRAME  # the window's first sample in HiFT's output
        audio, phase = self.mel2wav.stream(mel, phases, snoise, theta0, at, 2 * r)
        audio = audio.gather(1, at[:, None] + torch.arange(2 * r * SAMPLES_PER_FRAME, device=dev))
        fade = fade_in(dev).to(audio.dtype)
        lead = torch.where(fresh[:, None], fade, torch.ones_like(fade))  # the utterance's first window
        audio = torch.cat([audio[:, : len(fade)] * lead, audio[:, len(fade) :]], dim=1)
        self.s_count[slot] = count
        self.s_key[slot] = key
        self.s_phase[slot] = phase.float()
        return audio

    # --- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str, dtype: torch.dtype, device, seed: int = 0) -> S3Gen:
        """Random weights (`random_init`) and a seeded random voice for a shipped config."""
        with open(path) as f:
            model = cls(json.load(f))
        random_init(model, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        p = model.cfg["prompt_tokens"]
        tokens = torch.randint(0, model.cfg["flow"]["vocab"], (p,), generator=gen)
        mel = torch.randn(model.mels, 2 * p, generator=gen) - 5.0  # log-mel-like levels
        model.set_voice(tokens, mel, torch.randn(model.cfg["flow"]["xvector_dim"], generator=gen))
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device) -> S3Gen:
        """`s3gen.safetensors`'s `flow.` and `mel2wav.` weights (weight norms folded) and the default
        voice of `conds.pt` (its `gen` part), with the published sizes (chatterbox-s3gen.json)."""
        from safetensors.torch import load_file

        path = id_or_dir
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, allow_patterns=["s3gen.safetensors", "conds.pt"])
        with open(os.path.join(os.path.dirname(__file__), "configs", "chatterbox-s3gen.json")) as f:
            model = cls(json.load(f))
        weights = load_file(os.path.join(path, "s3gen.safetensors"))
        weights = {k: v for k, v in weights.items() if k.startswith(("flow.", "mel2wav."))}
        model.load_state_dict(fold_weight_norm(weights))
        gen = torch.load(os.path.join(path, "conds.pt"), map_location="cpu", weights_only=True)["gen"]
        mel = gen["prompt_feat"].reshape(-1, model.mels).T  # [80, 2P]
        tokens = gen["prompt_token"].reshape(-1)[: mel.shape[1] // 2]  # two frames a token, as embed_ref
        mel = mel[:, : 2 * len(tokens)]
        model.set_voice(tokens, mel, gen["embedding"].reshape(-1))
        return model.to(device=device, dtype=dtype).eval()


def fold_weight_norm(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight-normed parameters (`parametrizations.weight.original0/1`, or `weight_g` / `weight_v`)
    as the plain `weight` they stand for: g · v / ‖v‖ over every dimension but the first."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        for g_suffix, v_suffix in WEIGHT_NORMS:
            if name.endswith(g_suffix):
                base = name[: -len(g_suffix)]
                out[base + ".weight"] = torch._weight_norm(weights[base + v_suffix], t, 0)
                break
            if name.endswith(v_suffix):
                break
        else:
            out[name] = t
    return out


@torch.no_grad()
def random_init(model: nn.Module, seed: int) -> None:
    """Random weights that keep activations at unit scale, so that a wrong layer shows in the audio:
    weights normal / sqrt(fan-in), norms and Snake frequencies 1 ± 0.1, biases and position biases
    normal · 0.1, drawn on the CPU in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "alpha" or (leaf == "weight" and p.dim() == 1):
            value = 1.0 + 0.1 * noise
        elif leaf == "bias" or leaf.startswith("pos_bias"):
            value = 0.1 * noise
        else:
            value = noise / np.sqrt(p[0].numel())
            if name.startswith("mel2wav.conv_post"):  # log-magnitudes near 0: audio short of the clamp
                value = value * 0.1
        p.copy_(value.to(p))
