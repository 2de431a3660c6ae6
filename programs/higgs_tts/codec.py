"""Higgs Audio v2 tokenizer's decoder (codes → 24 kHz audio), decoding each request as a stream.

The network is the reference's decode path (transformers' `HiggsAudioV2TokenizerModel.decode`)
under its parameter names, so the checkpoint's weights load unchanged: the residual quantizer's
first 8 codebooks (`quantizer.quantizers.{k}`: `codebook.embed[code]` through `project_out`,
summed), `fc2` to the acoustic width, and the DAC decoder (`acoustic_decoder`: a kernel-7 conv,
blocks of Snake + transposed conv (kernel 2s, stride s) + residual units of dilations 1, 3, 9, then
Snake and a kernel-7 conv; no tanh), 960 samples per frame (8·5·4·2·3).

Every convolution of the decoder is centered, so a stream runs it with a lag: each layer keeps the
inputs its kernel still needs (a conv of kernel 7 and dilation d its last 6d inputs, a transposed
conv its last input, a residual unit its last 3d inputs to add to the conv's lagged output), and
each call feeds one latent frame through every layer, which returns the samples it can now
complete: `decoder_lag` (spec.py) behind, rounded up to whole frames by a last delay line. Each
layer's input is zeroed outside the utterance (positions before 0, and from its end on once the
all-eos row came), which is what the whole utterance's zero padding gives, so the streamed audio
equals `decode_all` to float rounding, for one frame's compute a frame.

A stream takes the LM's rows in the delay pattern (programs/higgs_tts/spec.py) and undoes it
itself: row c (counted from the last all-bos row) carries codebook k of frame c - k - 1; frame
c - 8 is complete at row c and goes into the decoder, which emits frame c - 8 - lag. Per codec slot
it keeps the row count, the utterance's frame count once its all-eos row arrived, the 8 frames
being assembled and every layer's inputs; `decode_stream` gathers and scatters them with device
tensors (graph-safe).
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from programs.blocks.weights import checkpoint_dir, copy_weights, load_safetensors
from programs.higgs_tts import spec as h

NO_END = 1 << 40  # a slot's frame count while its utterance has not ended


class Snake(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.snake1 = Snake(c_in)
        self.conv_t1 = nn.ConvTranspose1d(
            c_in, c_out, 2 * stride, stride, padding=math.ceil(stride / 2), output_padding=stride % 2
        )
        self.res_unit1 = ResidualUnit(c_out, 1)
        self.res_unit2 = ResidualUnit(c_out, 3)
        self.res_unit3 = ResidualUnit(c_out, 9)


class AcousticDecoder(nn.Module):
    """The DAC decoder: `forward` decodes a whole utterance, `step` one frame of streams."""

    def __init__(self, acoustic: dict[str, Any]) -> None:
        super().__init__()
        dim, ratios = acoustic["decoder_hidden_size"], list(acoustic["upsampling_ratios"])
        self.conv1 = nn.Conv1d(acoustic["hidden_size"], dim, 7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(dim // 2**i, dim // 2 ** (i + 1), s) for i, s in enumerate(ratios)
        )
        out = dim // 2 ** len(ratios)
        self.snake1 = Snake(out)
        self.conv2 = nn.Conv1d(out, 1, 7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, D, T] latent frames → audio [B, T * hop] (the whole utterance: zero padding)."""
        h = self.conv1(x)
        for block in self.block:
            h = block.conv_t1(block.snake1(h))
            h = block.res_unit3(block.res_unit2(block.res_unit1(h)))
        return self.conv2(self.snake1(h))[:, 0]

    def state_shapes(self, lag: int) -> list[tuple[int, int]]:
        """(channels, samples) of each input a stream keeps, in `step`'s order."""
        shapes = [(self.conv1.in_channels, 6)]
        for block in self.block:
            shapes.append((block.conv_t1.in_channels, 1))
            c = block.conv_t1.out_channels
            shapes += [shape for d in (1, 3, 9) for shape in ((c, 6 * d), (c, 3 * d))]
        shapes.append((self.conv2.in_channels, 6))
        hop = math.prod(b.stride for b in self.block)
        delay = -(-lag // hop) * hop - lag
        return shapes + ([(1, delay)] if delay else [])

    def step(
        self, x: torch.Tensor, frame: torch.Tensor, n_end: torch.Tensor, held: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """n latent frames of each stream through every layer: x [B, D, n] latent frames `frame`
        [B] on of utterances of n_end [B] frames, held the kept inputs (`state_shapes`) → (audio
        [B, n * hop] of the frames `decoder_lag` frames back, the inputs to keep)."""
        n = x.shape[-1]
        kept: list[torch.Tensor] = []
        old = iter(held)

        def inside(h: torch.Tensor, rate: int, lag: int) -> torch.Tensor:
            pos = frame[:, None] * rate - lag + torch.arange(h.shape[-1], device=h.device)[None]
            return h * ((pos >= 0) & (pos < n_end[:, None] * rate))[:, None, :].to(h.dtype)

        def conv(mod: nn.Conv1d, h: torch.Tensor, keep: int) -> torch.Tensor:
            full = torch.cat([next(old), h], dim=-1)
            kept.append(full[..., -keep:])
            return F.conv1d(full, mod.weight, mod.bias, dilation=mod.dilation)

        rate, lag = 1, 0
        h = conv(self.conv1, inside(x, rate, lag), 6)
        lag += 3
        for block in self.block:
            s = block.stride
            h = block.snake1(inside(h, rate, lag))
            full = torch.cat([next(old), h], dim=-1)
            kept.append(h[..., -1:])
            # the outputs every input of which is here: n * rate * s of them, from the previous input on
            h = F.conv_transpose1d(full, block.conv_t1.weight, block.conv_t1.bias, stride=s)[
                ..., s : s + n * rate * s
            ]
            rate, lag = rate * s, lag * s + math.ceil(s / 2)
            for unit, d in zip((block.res_unit1, block.res_unit2, block.res_unit3), (1, 3, 9), strict=True):
                h = inside(h, rate, lag)
                y = unit.conv2(unit.snake2(conv(unit.conv1, unit.snake1(h), 6 * d)))
                late = torch.cat([next(old), h], dim=-1)  # the input, 3d samples late as conv1's output
                kept.append(late[..., -3 * d :])
                h = late[..., : n * rate] + y
                lag += 3 * d
        h = conv(self.conv2, self.snake1(inside(h, rate, lag)), 6)
        if len(kept) < len(held):  # the delay line that rounds the lag up to whole frames
            full = torch.cat([next(old), h], dim=-1)
            kept.append(full[..., -held[-1].shape[-1] :])
            h = full[..., : n * rate]
        return h[:, 0], kept


class _Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(size, dim))


class _Quantizer(nn.Module):
    def __init__(self, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.codebook = _Codebook(size, dim)
        self.project_out = nn.Linear(dim, width)


class _ResidualQuantizer(nn.Module):
    def __init__(self, n: int, size: int, dim: int, width: int) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(_Quantizer(size, dim, width) for _ in range(n))


class HiggsCodec(nn.Module):
    """The decoder of bosonai/higgs-audio-v2-tokenizer, decoding streams in slots. `cfg` is the
    tokenizer config (transformers' layout)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        acoustic, semantic = cfg["acoustic_model_config"], cfg["semantic_model_config"]
        width = acoustic["hidden_size"] + semantic["hidden_size"]
        self.quantizer = _ResidualQuantizer(h.N_CODEBOOKS, cfg["codebook_size"], cfg["codebook_dim"], width)
        self.fc2 = nn.Linear(width, acoustic["hidden_size"])
        self.acoustic_decoder = AcousticDecoder(acoustic)
        self.samples_per_frame = math.prod(acoustic["upsampling_ratios"])
        lag, self.lag_frames = h.decoder_lag(acoustic)
        self.shapes = self.acoustic_decoder.state_shapes(lag)
        self.count: torch.Tensor | None = None  # [n] int64 index of the slot's last row (-1: none)
        self.n_end = torch.empty(0)  # [n] int64 frames of the slot's utterance, NO_END until known
        self.pending = torch.empty(0)  # [n, 8, 8] int64 frames being assembled, by frame % 8
        self.held: list[torch.Tensor] = []  # [n, C, S] each decoder layer's kept inputs

    def latent(self, codes: torch.Tensor) -> torch.Tensor:
        """Frames' codes [..., 8] in [0, 1024) → latents [..., D] (the quantizer's sum, then fc2)."""
        out = torch.zeros((), dtype=self.fc2.weight.dtype, device=codes.device)
        for k, q in enumerate(self.quantizer.quantizers):
            out = out + q.project_out(F.embedding(codes[..., k], q.codebook.embed))
        return self.fc2(out)

    @torch.no_grad()
    def decode_all(self, codes: torch.Tensor) -> torch.Tensor:
        """Frames [T, 8] of codes → the whole utterance's audio [T * 960] float32."""
        x = self.latent(codes.clamp(0, h.CODES - 1))[None].transpose(1, 2)
        return self.acoustic_decoder(x)[0].float()

    def init_streams(self, n_slots: int) -> None:
        dev, dtype = self.fc2.weight.device, self.fc2.weight.dtype
        self.count = torch.full((n_slots,), -1, dtype=torch.int64, device=dev)
        self.n_end = torch.full((n_slots,), NO_END, dtype=torch.int64, device=dev)
        self.pending = torch.zeros(n_slots, h.N_CODEBOOKS, h.N_CODEBOOKS, dtype=torch.int64, device=dev)
        self.held = [torch.zeros(n_slots, c, k, dtype=dtype, device=dev) for c, k in self.shapes]

    @torch.no_grad()
    def decode_stream(self, rows: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Entry b takes its next R rows, rows [Bd, R, 8] int64, continuing the stream in slot
        `slots[b]` (reset first where `fresh[b]`) → (audio [Bd, R * 960] float32, valid [Bd, R]
        bool: whether each row's frame of audio exists). Graph-safe."""
        count = torch.where(fresh, -1, self.count.index_select(0, slots))
        n_end = torch.where(fresh, NO_END, self.n_end.index_select(0, slots))
        pending = self.pending.index_select(0, slots)
        held = [torch.where(fresh[:, None, None], 0, t.index_select(0, slots)) for t in self.held]
        codes, dones = [], []
        for r in range(rows.shape[1]):
            count, n_end, frame_codes = self._row(rows[:, r], count, n_end, pending)
            codes.append(frame_codes)
            dones.append(count - 8)  # the frame the row completes
        # The window's R frames through the decoder at once, numbered on from the first row's. An
        # all-bos row restarts the count only at a stream's start, where every frame of a window
        # (at most 8 rows) lies before frame 0 and is masked whatever its number.
        latents = self.latent(torch.stack(codes, dim=1).clamp(0, h.CODES - 1))  # [Bd, R, D]
        audio, held = self.acoustic_decoder.step(latents.transpose(1, 2), dones[0], n_end, held)
        f = torch.stack(dones, dim=1) - self.lag_frames  # [Bd, R] the frames the window emits
        self.count.index_copy_(0, slots, count)
        self.n_end.index_copy_(0, slots, n_end)
        self.pending.index_copy_(0, slots, pending)
        for t, new in zip(self.held, held, strict=True):
            t.index_copy_(0, slots, new)
        return audio.float(), (f >= 0) & (f < n_end[:, None])

    def _row(self, row, count, n_end, pending):
        """One row of each entry: de-delay it into `pending` (in place) → (its count, n_end, the
        codes [Bd, 8] of the frame it completes)."""
        c = torch.where((row == h.STREAM_BOS).all(1), 0, count + 1)  # [Bd]
        ended = (row >= h.STREAM_EOS).all(1) & (n_end == NO_END)
        n_end = torch.where(ended, c - 8, n_end)
        k = torch.arange(h.N_CODEBOOKS, device=row.device)
        frame = (c[:, None] - 1 - k[None]) % h.N_CODEBOOKS  # [Bd, 8] the frame each code belongs to
        pending.scatter_(1, frame[:, None, :], row[:, None, :])
        index = ((c - 8) % h.N_CODEBOOKS)[:, None, None].expand(-1, 1, h.N_CODEBOOKS)
        return c, n_end, pending.gather(1, index)[:, 0]

    def slot_bytes(self) -> int:
        """Bytes of state one slot holds."""
        return 16 + 64 * 8 + sum(c * k for c, k in self.shapes) * self.fc2.weight.element_size()

    @classmethod
    def from_config(cls, path: str, dtype: torch.dtype, device, seed: int = 0) -> HiggsCodec:
        """Random weights and random codebooks (`random_init`) for a shipped config."""
        with open(path) as f:
            model = cls(json.load(f))
        random_init(model, seed)
        return model.to(device=device, dtype=dtype).eval()

    @classmethod
    def from_pretrained(cls, id_or_dir: str, dtype: torch.dtype, device) -> HiggsCodec:
        """The tokenizer checkpoint in transformers' layout: its quantizer codebooks and output
        projections, `fc2` and `acoustic_decoder.*` (weight-normed convolutions folded)."""
        return load_parts(cls, id_or_dir, dtype, device, ("quantizer", "fc2", "acoustic_decoder"))


def load_parts(cls: type[nn.Module], id_or_dir: str, dtype: torch.dtype, device, parts: tuple[str, ...]):
    """`cls(config)` with the weights of the tokenizer checkpoint's top-level `parts` (transformers'
    layout, weight-normed tensors folded); every parameter of the module must come from them."""
    path, config = checkpoint_dir(id_or_dir)
    with torch.device(device):
        model = cls(config).to(dtype)
    own = {n for n, _ in model.named_parameters()}
    held: dict[str, torch.Tensor] = {}

    def load(pairs):
        for name, t in pairs:
            held[name] = t
        return set()

    load_safetensors(path, device, load, keep=lambda n: n.split(".")[0] in parts)
    loaded = copy_weights(model, fold_weight_norm(held).items(), skip=lambda n: n not in own)
    missing = own - loaded
    if missing:
        raise KeyError(f"{path}: no weights for {sorted(missing)[:5]} ({len(missing)} in all)")
    return model.eval()


def fold_weight_norm(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weight-normed tensors (`X.weight_g` / `X.weight_v`, or `X.parametrizations.weight.original0`
    / `original1`) → `X.weight` = g · v / ‖v‖, the norm over the dims where g has size 1 (every dim
    but the first for the DAC convolutions, all but the kernel's for HuBERT's positional conv)."""
    out = dict(weights)
    for g_name in [n for n in weights if n.endswith((".weight_g", ".parametrizations.weight.original0"))]:
        base = g_name.removesuffix(".weight_g").removesuffix(".parametrizations.weight.original0")
        v_name = (
            g_name[: -len("original0")] + "original1" if "parametrizations" in g_name else base + ".weight_v"
        )
        g, v = out.pop(g_name), out.pop(v_name)
        dims = tuple(i for i in range(v.dim()) if g.shape[i] == 1)
        norm = v.float().pow(2).sum(dim=dims, keepdim=True).sqrt()
        out[base + ".weight"] = (v.float() * (g.float() / norm)).to(v.dtype)
    return out


@torch.no_grad()
def random_init(model: HiggsCodec, seed: int) -> None:
    """Random weights that keep the signal's scale through the decoder and make every part count:
    random codebooks (a zero codebook would decode every code alike), non-zero biases, Snake alphas
    around 1, and an output mostly inside [-1, 1]. Drawn on the CPU in float32 in parameter order,
    so a seed gives the same model on any device."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "embed":
            p.copy_(torch.randn(p.shape, generator=gen))
        elif leaf == "alpha":
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif leaf == "bias":
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        elif name.endswith("conv_t1.weight"):  # [in, out, k]: k / stride inputs reach an output
            p.copy_(torch.randn(p.shape, generator=gen) * (2 * p.shape[0]) ** -0.5)
        else:
            fan_in = p[0].numel()
            gain = 0.3 if name.endswith("conv2.weight") and "res_unit" in name else 1.0
            gain = 0.06 if name == "acoustic_decoder.conv2.weight" else gain
            p.copy_(torch.randn(p.shape, generator=gen) * gain * fan_in**-0.5)
