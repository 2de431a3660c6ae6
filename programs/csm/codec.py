"""Mimi for CSM's audio: transformers' `MimiModel` (the reference codec itself), decoded as streams.

Loading: `kyutai/mimi`-shaped weights either from a MimiModel checkpoint (dir or hub id with a
MimiConfig) or from sesame/csm-1b, whose safetensors carry the codec under `codec_model.*`; or
random weights from a shipped config (--load-format dummy, csm-tiny).

Streams: `init_streams` / `decode_stream` decode each frame once, carrying every stream's decoder
state (transformer keys and values, convolution histories) in slots (programs/csm/mimi_stream.py):
the audio of `decode_all` over the whole stream, to fp32 rounding.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from programs.blocks.weights import checkpoint_dir


def random_codebooks(model) -> None:
    """Random code vectors for a randomly initialised MimiModel. transformers starts every codebook
    at zero (its vectors are buffers a checkpoint fills), so every code would decode to the same
    audio and no test could tell one code from another. Draws from the global torch generator."""
    for m in model.modules():
        if type(m).__name__ == "MimiEuclideanCodebook":
            m.embed_sum.copy_(torch.randn_like(m.embed_sum))
            m.cluster_usage.fill_(1.0)
            m._embed = None  # the cached embed = embed_sum / cluster_usage


class MimiCodec:
    def __init__(self, model) -> None:
        self.model = model  # transformers MimiModel, eval, on its device
        self.codebook_size = model.config.codebook_size
        self.samples_per_frame = int(model.config.sampling_rate / model.config.frame_rate)
        self.streams = None  # MimiStreamDecoder, built by init_streams

    def init_streams(self, n_slots: int) -> None:
        """Allocate the stream state of `n_slots` requests (programs/csm/mimi_stream.py)."""
        from programs.csm.mimi_stream import MimiStreamDecoder

        self.streams = MimiStreamDecoder(self.model)
        self.streams.init_streams(n_slots)

    def decode_stream(self, codes: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """codes [Bd, R, 32] int64 continuing the streams in `slots` [Bd] (restarted where `fresh`
        [Bd] bool) → audio [Bd, R * 1920]: each frame decoded once, equal to `decode_all` of the
        whole stream. Graph-safe; needs `init_streams` first."""
        return self.streams.decode_stream(codes, slots, fresh).float()

    @torch.no_grad()
    def decode_all(self, frames: torch.Tensor) -> torch.Tensor:
        """The reference's decode of a whole stream: [T, 32] → [T * 1920]."""
        return self.model.decode(frames.T[None]).audio_values[0, 0]

    @classmethod
    def from_config(cls, path: str, dtype: torch.dtype, device, seed: int = 0) -> MimiCodec:
        from transformers import MimiConfig, MimiModel

        with open(path) as f:
            cfg = MimiConfig(**json.load(f))
        torch.manual_seed(seed)  # transformers' own init; fixed seed so every process builds the same
        model = MimiModel(cfg)
        random_codebooks(model)
        return cls(model.to(device=device, dtype=dtype).eval())

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device) -> MimiCodec:
        """A MimiModel checkpoint, or a CSM checkpoint holding Mimi under `codec_model.*`."""
        from transformers import MimiConfig, MimiModel

        path, config = checkpoint_dir(id_or_dir)
        if config.get("model_type") != "csm":
            return cls(MimiModel.from_pretrained(path, dtype=dtype).to(device).eval())
        from safetensors import safe_open

        model = MimiModel(MimiConfig(**config["codec_config"]))
        state = {}
        for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            with safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    if name.startswith("codec_model."):
                        state[name.removeprefix("codec_model.")] = f.get_tensor(name)
        model.load_state_dict(state, strict=True)
        return cls(model.to(device=device, dtype=dtype).eval())
