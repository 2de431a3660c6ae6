"""Qwen3-TTS-Tokenizer-12Hz's decoder (codes → 24 kHz audio), decoding each request as a stream.

The network is the reference's `Qwen3TTSTokenizerV2Decoder` (qwen-tts, tokenizer_12hz) under its
parameter names, so the checkpoint's `decoder.*` weights load unchanged: the split residual
quantizer (codebook 0; codebooks 1..15; a code's vector is `embedding_sum / cluster_usage`), a
causal pre-convolution, a transformer with RoPE over a sliding window, two ×2 upsampling stages
(transposed conv + ConvNeXt block), the DAC-like decoder (SnakeBeta, transposed convs of kernel 2r
and stride r, residual units of dilations 1, 3, 9): 1920 samples per frame (8·5·4·3·2·2).

Every layer is causal, so a whole utterance decodes a window of frames at a time, each frame once,
where each stateful layer keeps what it needs of the past: a causal conv its last
(kernel - 1) · dilation input samples (its left padding); a transposed conv of kernel 2r its last
input, whose second half-kernel overlaps the next input's outputs; attention the rotated keys and
values of its last `sliding_window - 1 + PASS_FRAMES` frames in a ring, with the stream's frame
position. `init_streams` allocates it per slot, in the codec's dtype; `decode_stream` moves only
what each layer reads and writes, with device tensors (graph-safe): a conv gathers its past (a
fresh entry's from a row kept at zero) and scatters its next; an attention scatters the new keys and
values into the ring in place and gathers the ring, masked by position (frames before a fresh
stream's start, or older than the window), so a fresh stream resets its position alone.
`decode_all` runs a whole utterance as one window from zero state: the reference's `forward`,
which its `decode` (`chunked_decode`) is up to 300 frames; longer utterances it decodes in
300-frame chunks with 25 frames of left context, an approximation of that whole decode.

configs/qwen3-tts-tokenizer-12hz.json holds the published config.json's values (top level and
`decoder_config`), as several independent public copies of Qwen/Qwen3-TTS-Tokenizer-12Hz/config.json
agree (ports' test fixtures, a build check running the reference on it); the checkpoint itself is
not read here. Its `encoder_config` (the reference clips' encoder, programs/blocks/mimi_encoder.py)
is Mimi's published config (kyutai/mimi) with `_frame_rate` 12.5, the values public ports' parsers
of that file list; the tiny one is CSM's mimi-tiny. The reference ignores
`semantic_codebook_size` (4096) and `vector_quantization_hidden_dimension` (512): every codebook
has `codebook_size` × `codebook_dim // 2` entries (public ports report 2048 × 256 in the
checkpoint; unverified). qwen3-tts-tokenizer-tiny.json keeps every structural feature (GQA, all
stages, 1920 samples per frame) at CPU-test size, with a 6-frame window.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors
from programs.qwen3_tts.codec_layers import (
    Attention,
    CausalConvNet,
    CausalTransConvNet,
    Contexts,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
    SplitResidualVectorQuantizer,
    Transformer,
)

# frames a stream's attention ring holds beyond the window's past: a pass of the transformer's,
# so a merged window (up to the program's largest codec_merge) runs its layers once
PASS_FRAMES = 8


class Qwen3TtsCodec(nn.Module):
    """The decoder of Qwen3-TTS-Tokenizer-12Hz (`decoder.*` of its checkpoint), decoding streams in
    slots. `cfg` is the checkpoint config's `decoder_config`."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"the codec's transformer runs SiLU, not {cfg['hidden_act']!r}")
        latent, dim = cfg["latent_dim"], cfg["decoder_dim"]
        rates, ratios = list(cfg["upsample_rates"]), list(cfg["upsampling_ratios"])
        self.n_codebooks = cfg["num_quantizers"]
        self.codebook_size = cfg["codebook_size"]
        self.samples_per_frame = math.prod(rates + ratios)
        self.quantizer = SplitResidualVectorQuantizer(cfg)
        self.pre_conv = CausalConvNet(cfg["codebook_dim"], latent, 3)
        self.pre_transformer = Transformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConvNet(latent, latent, f, f), ConvNeXtBlock(latent)]) for f in ratios
        )
        blocks = [DecoderBlock(dim // 2**i, rate) for i, rate in enumerate(rates)]
        out = dim // 2 ** len(rates)
        self.decoder = nn.ModuleList(
            [CausalConvNet(latent, dim, 7), *blocks, SnakeBeta(out), CausalConvNet(out, 1, 7)]
        )
        self.stateful = [m for m in self.modules() if getattr(m, "state_shape", None)]
        for i, m in enumerate(self.stateful):
            m.state_index = i
        self.states: list[torch.Tensor] = []  # per stateful layer, `_zero_states`
        self.positions: torch.Tensor | None = None  # [n_slots] int64, frames a slot has decoded

    def run(self, codes: torch.Tensor, start: torch.Tensor, ctx: Contexts) -> torch.Tensor:
        """codes [B, R, C] int64, start [B] int64 (frames before them), ctx (the state, advanced
        in place) → audio [B, R * samples_per_frame] in [-1, 1]."""
        h = self.pre_conv(self.quantizer.decode(codes).transpose(1, 2), ctx)
        h = self.pre_transformer(h.transpose(1, 2), start, ctx).transpose(1, 2)
        for trans, block in self.upsample:
            h = block(trans(h, ctx), ctx)
        h = self.decoder[0](h, ctx)
        for block in self.decoder[1:-2]:
            h = block(h, ctx)
        h = self.decoder[-1](self.decoder[-2](h), ctx)
        return h[:, 0].clamp(-1.0, 1.0)

    def _row_shapes(self, ring_frames: int) -> list[tuple[int, ...]]:
        """One slot's state per stateful layer: a conv's `state_shape`, an attention's ring of
        `window - 1 + ring_frames` frames [2, kv_heads, ring, head_dim]."""
        return [
            (2, m.kv_heads, m.window - 1 + ring_frames, m.head_dim)
            if isinstance(m, Attention)
            else m.state_shape
            for m in self.stateful
        ]

    def _zero_states(self, n: int, ring_frames: int) -> list[torch.Tensor]:
        """Zeroed state of n slots in the codec's dtype: the rings [n, ...], each conv's [n + 1, ...]
        (its last row stays zero: what fresh entries read)."""
        p = self.pre_conv.conv.weight
        return [
            p.new_zeros((n if isinstance(m, Attention) else n + 1, *shape))
            for m, shape in zip(self.stateful, self._row_shapes(ring_frames), strict=True)
        ]

    @torch.no_grad()
    def decode_all(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole utterance in one window from a fresh state: codes [T, C] → [T * 1920] float32."""
        first = torch.zeros(1, dtype=torch.int64, device=codes.device)
        ctx = Contexts(self._zero_states(1, codes.shape[0]), first, first)
        return self.run(codes[None], first, ctx)[0].float()

    def init_streams(self, n_slots: int) -> None:
        """Allocate (zeroed) the state of `n_slots` streams on the codec's device, in its dtype."""
        self.states = self._zero_states(n_slots, PASS_FRAMES)
        self.positions = torch.zeros(n_slots, dtype=torch.int64, device=self.pre_conv.conv.weight.device)

    def slot_bytes(self) -> int:
        """Bytes of state one slot holds (its position included)."""
        values = sum(math.prod(shape) for shape in self._row_shapes(PASS_FRAMES))
        return values * self.pre_conv.conv.weight.element_size() + 8

    @torch.no_grad()
    def decode_stream(self, codes: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Entry b decodes its next R frames, codes [Bd, R, C] int64, continuing the stream in slot
        `slots[b]` ([Bd] int64; a slot appears once per call, but for a padding slot), whose state
        is reset first where `fresh[b]` ([Bd] bool); → audio [Bd, R * 1920] float32. Graph-safe.

        State moves per layer: a conv gathers its past ([Bd, C, context], from the zero row where
        fresh) and scatters its next; an attention scatters the R new keys and values into the
        slots' rings and gathers the rings, whose frames from before a fresh start its mask hides
        (a fresh entry's position restarts at 0)."""
        start = torch.where(fresh, 0, self.positions.index_select(0, slots))
        read = torch.where(fresh, self.positions.shape[0], slots)  # conv states' zero row
        audio = self.run(codes, start, Contexts(self.states, slots, read))
        self.positions.index_copy_(0, slots, start + codes.shape[1])
        return audio.float()

    def compiled(self, backend: str = "inductor") -> Callable[..., torch.Tensor]:
        """`decode_stream` under `torch.compile` (`backend`), compiled at its first calls: once for
        windows of one frame and once for every longer window up to a pass (the window's length
        dynamic), per call size. The compiler fuses the elementwise work (every SnakeBeta, RMSNorm,
        RoPE, residual add and layer scale) and moves each layer's state with its neighbours,
        leaving GEMMs and the dense convolutions to cuBLAS and cuDNN: an eager call of 16
        one-frame windows is about 1,000 kernels, launch-bound at the few frames a stream has
        waiting. The state buffers are updated in place, so its CUDA graphs read and write the
        slots' state as the eager decode's do."""
        # every codec of a process compiles `decode_stream`'s code object, past dynamo's default of 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        fn = torch.compile(self.decode_stream, backend=backend, dynamic=False)

        def decode(codes: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
            torch._dynamo.maybe_mark_dynamic(codes, 1)  # a frame alone stays a compile of its own
            return fn(codes, slots, fresh)

        return decode

    @torch.no_grad()
    def prime(self, codes: torch.Tensor, slots: torch.Tensor) -> None:
        """Start the streams in `slots` [B] int64 with codes [B, P, C] from a fresh state, their audio
        dropped: one pass over all P frames (rings that hold them all, as `decode_all`), then each
        stateful layer's end state into the slots: what `decode_stream` leaves after them (up to
        rounding), without its pass per PASS_FRAMES frames (a clip of 375 frames: 47 passes of 8
        layers, eager). Eager, with device indices only (no host read)."""
        b, p = codes.shape[:2]
        rows = torch.arange(b, device=codes.device)
        wide = self._zero_states(b, p)
        self.run(codes, torch.zeros_like(rows), Contexts(wide, rows, torch.full_like(rows, b)))
        for m, state, temp in zip(self.stateful, self.states, wide, strict=True):
            if not isinstance(m, Attention):
                state.index_copy_(0, slots, temp[:b])
                continue
            # frame f sits at f in the wide ring, at f % ring in a slot's; frames before the last
            # `ring` are past every window, and slots' entries for frames < 0 are masked
            ring = state.shape[3]
            frames = torch.arange(max(0, p - ring), p, device=codes.device)  # [F]
            # [B, F] (slot, ring entry) pairs, each once: [B, F, 2, kv_heads, head_dim] values
            state[slots[:, None], :, :, (frames % ring)[None]] = temp[:, :, :, frames].permute(0, 3, 1, 2, 4)
        self.positions.index_fill_(0, slots, p)

    @classmethod
    def from_config(cls, path: str, dtype: torch.dtype, device, seed: int = 0) -> Qwen3TtsCodec:
        """Random weights and random codebooks (`random_init`) for a shipped config."""
        with open(path) as f:
            cfg = json.load(f)["decoder_config"]
        model = cls(cfg)
        random_init(model, seed)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device) -> Qwen3TtsCodec:
        """The tokenizer checkpoint (Qwen/Qwen3-TTS-Tokenizer-12Hz, or a Qwen3-TTS model directory
        holding it in speech_tokenizer/): its `decoder.*` weights, every parameter required."""
        path, config = checkpoint_dir(id_or_dir)
        inner = os.path.join(path, "speech_tokenizer")
        if "decoder_config" not in config and os.path.isdir(inner):
            path, config = checkpoint_dir(inner)
        with torch.device(device):
            model = cls(config["decoder_config"]).to(dtype)
        prefix = "decoder."

        def load(pairs):
            named = ((name.removeprefix(prefix), t) for name, t in pairs)
            return copy_weights(model, named, skip=lambda name: name.endswith("rotary_emb.inv_freq"))

        loaded = load_safetensors(path, device, load, keep=lambda name: name.startswith(prefix))
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise KeyError(f"{path}: no weights for {sorted(missing)[:5]} ({len(missing)} in all)")
        return model.eval()


@torch.no_grad()
def random_init(model: Qwen3TtsCodec, seed: int) -> None:
    """Random weights that keep the signal's scale through the layers and make every part count:
    random codebooks (a zero codebook would decode every code alike), non-zero biases, norm and
    scale weights around their use, and an output mostly inside the [-1, 1] clamp. Drawn on the CPU
    in float32 in the order of the parameters, so a seed gives the same model on any device."""
    gen = torch.Generator().manual_seed(seed)

    def draw(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    last = f"decoder.{len(model.decoder) - 1}.conv.weight"
    per_output = {
        id(m.conv.weight): m.conv.kernel_size[0] // m.stride
        for m in model.modules()
        if isinstance(m, CausalTransConvNet)
    }
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embedding_sum":
            draw(p, 1.0)
        elif leaf == "cluster_usage":
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf in ("alpha", "beta"):
            draw(p, 0.3)
        elif leaf in ("scale", "gamma"):
            draw(p, 0.1, 0.5)
        elif leaf == "bias":
            draw(p, 0.1)
        elif p.dim() == 1:  # norm weights
            draw(p, 0.1, 1.0)
        elif id(p) in per_output:  # transposed [in, out, k]: k / stride inputs per output
            draw(p, (p.shape[0] * per_output[id(p)]) ** -0.5)
        else:  # [out, in] or [out, in / groups, k]: residual units add a third, the output std ~0.25
            gain = 0.3 if name.endswith("conv2.conv.weight") else 0.1 if name == last else 1.0
            draw(p, gain * p[0].numel() ** -0.5)
