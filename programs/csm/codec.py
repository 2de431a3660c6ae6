"""Mimi for CSM's audio: transformers' `MimiModel` (the reference codec itself), decoding windows.

Loading: `kyutai/mimi`-shaped weights either from a MimiModel checkpoint (dir or hub id with a
MimiConfig) or from sesame/csm-1b, whose safetensors carry the codec under `codec_model.*`; or
random weights from a shipped config (--load-format dummy, csm-tiny).

Windows: the runtime hands `decode_window` [Bd, detok_interval, 32] frames (fewer for a stream's
start windows); each is decoded alone
(`MimiModel.decode`) and only the samples of its last `stride` frames are kept. Mimi's decoder is
causal (causal convolutions, a causal transformer over a 250-step sliding window), so a kept sample
depends only on earlier frames; what a window lacks is context older than its first frame, which
the whole-sequence decode has. So a window's samples equal MimiModel.decode of that window exactly,
and they equal the decode of the whole stream as far as `detok_overlap` frames of context carry.
With 8 frames, on random weights with random codebooks (`random_codebooks`): csm-tiny's Mimi to
5e-6; the real kyutai/mimi shape to 7e-3 of a 29 peak, 74 dB SNR over 100 frames, from its
transformer's longer reach. Trained weights may differ: bench/csm_windows.py measures any weights.

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


def keep_shape_buffers_on_host(model) -> None:
    """MimiConv1d computes its padding from stride/kernel buffers; on a GPU that is a device→host
    read per convolution, which CUDA graph capture forbids. The same integers on the CPU give the
    same padding with no sync (the weights and activations stay on the device)."""
    for m in model.modules():
        for name in ("stride", "kernel_size", "padding_total"):
            buf = m._buffers.get(name) if hasattr(m, "_buffers") else None
            if buf is not None and buf.dtype == torch.int64 and buf.dim() == 0:
                m._buffers[name] = buf.cpu()


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
    def __init__(self, model, stride: int) -> None:
        keep_shape_buffers_on_host(model)
        self.model = model  # transformers MimiModel, eval, on its device
        self.stride = stride  # frames each window adds
        self.codebook_size = model.config.codebook_size
        self.samples_per_frame = int(model.config.sampling_rate / model.config.frame_rate)
        self.streams = None  # MimiStreamDecoder, built by init_streams

    @torch.no_grad()
    def decode_window(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[Bd, T, 32] int64 → audio [Bd, stride * 1920] float32, valid [Bd] bool (all True).

        A window is decoded as it stands, from its first frame on: the runtime strips a stream's
        leading pad frames (its preseed), so a stream's first windows come shorter (start windows,
        programs/base.py) and decode exactly as the whole-stream decode starts. The LM's extra ids
        (2048..2050) have no Mimi code and are decoded as the last code, 2047:
        - trailing pad frames (a stream's last, flushed window): Mimi is causal, so they change no
          sample before them, and the runtime drops their own;
        - a sampled extra id, which trained weights do not produce (the reference's decode would
          fail on it) and random weights do in ~3.5 % of csm-1b frames: the frame still sounds, so
          the stream keeps its timeline. Dropping the window instead would cut 960 ms of audio,
          since the frame sits in three overlapping windows."""
        valid = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        codes = tokens.clamp(0, self.codebook_size - 1).transpose(1, 2)  # [Bd, 32, T]
        keep = self.stride * self.samples_per_frame
        return self.model.decode(codes).audio_values[:, 0, -keep:].float(), valid

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
    def from_config(cls, path: str, stride: int, dtype: torch.dtype, device, seed: int = 0) -> MimiCodec:
        from transformers import MimiConfig, MimiModel

        with open(path) as f:
            cfg = MimiConfig(**json.load(f))
        torch.manual_seed(seed)  # transformers' own init; fixed seed so every process builds the same
        model = MimiModel(cfg)
        random_codebooks(model)
        return cls(model.to(device=device, dtype=dtype).eval(), stride)

    @classmethod
    def from_pretrained(cls, id_or_dir: str, stride: int, dtype: torch.dtype, device) -> MimiCodec:
        """A MimiModel checkpoint, or a CSM checkpoint holding Mimi under `codec_model.*`."""
        from transformers import MimiConfig, MimiModel

        path, config = checkpoint_dir(id_or_dir)
        if config.get("model_type") != "csm":
            return cls(MimiModel.from_pretrained(path, dtype=dtype).to(device).eval(), stride)
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
