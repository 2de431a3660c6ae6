"""Mimi for CSM's audio: transformers' `MimiModel` (the reference codec itself), decoding windows.

Loading: `kyutai/mimi`-shaped weights either from a MimiModel checkpoint (dir or hub id with a
MimiConfig) or from sesame/csm-1b, whose safetensors carry the codec under `codec_model.*`; or
random weights from a shipped config (--load-format dummy, csm-tiny).

Windows: the runtime hands `decode_window` [Bd, detok_interval, 32] frames; each is decoded alone
(`MimiModel.decode`) and only the samples of its last `stride` frames are kept. Mimi's decoder is
causal (causal convolutions, a causal transformer over a 250-step sliding window), so a kept sample
depends only on earlier frames; what a window lacks is context older than its first frame, which
the whole-sequence decode has. So a window's samples equal MimiModel.decode of that window exactly,
and they equal the decode of the whole stream as far as `detok_overlap` frames of context carry
(bench/csm_windows.py measures how far, per config).
"""

from __future__ import annotations

import glob
import json
import os

import torch


class MimiCodec:
    def __init__(self, model, stride: int) -> None:
        self.model = model  # transformers MimiModel, eval, on its device
        self.stride = stride  # frames each window adds
        self.codebook_size = model.config.codebook_size
        self.samples_per_frame = int(model.config.sampling_rate / model.config.frame_rate)

    @torch.no_grad()
    def decode_window(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, T, 32] int64 → audio [Bd, stride * 1920] float32, valid [Bd] bool (every code is a
        Mimi code: the LM's extra ids 2048..2050 have no audio)."""
        valid = (tokens < self.codebook_size).all(dim=2).all(dim=1)  # [Bd]
        codes = tokens.clamp(0, self.codebook_size - 1).transpose(1, 2)  # [Bd, 32, T]
        audio = self.model.decode(codes).audio_values[:, 0]  # [Bd, T * 1920]
        return audio[:, -self.stride * self.samples_per_frame :].float(), valid

    @torch.no_grad()
    def decode_all(self, frames: torch.Tensor) -> torch.Tensor:
        """The reference's decode of a whole stream: [T, 32] → [T * 1920]."""
        return self.model.decode(frames.T[None]).audio_values[0, 0]

    @classmethod
    def from_config(cls, path: str, stride: int, dtype: torch.dtype, device, seed: int = 0) -> MimiCodec:
        from transformers import MimiConfig, MimiModel

        with open(path) as f:
            cfg = MimiConfig(**json.load(f))
        torch.manual_seed(seed)  # transformers' own init; fixed seed so every process builds the same
        model = MimiModel(cfg).to(device=device, dtype=dtype).eval()
        return cls(model, stride)

    @classmethod
    def from_pretrained(cls, id_or_dir: str, stride: int, dtype: torch.dtype, device) -> MimiCodec:
        """A MimiModel checkpoint, or a CSM checkpoint holding Mimi under `codec_model.*`."""
        from transformers import MimiConfig, MimiModel

        path = id_or_dir
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(id_or_dir, allow_patterns=["*.json", "*.safetensors"])
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        if config.get("model_type") != "csm":
            return cls(MimiModel.from_pretrained(path, torch_dtype=dtype).to(device).eval(), stride)
        from safetensors import safe_open

        model = MimiModel(MimiConfig(**config["codec_config"]))
        state = {}
        for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    if name.startswith("codec_model."):
                        state[name.removeprefix("codec_model.")] = f.get_tensor(name)
        model.load_state_dict(state, strict=True)
        return cls(model.to(device=device, dtype=dtype).eval(), stride)
