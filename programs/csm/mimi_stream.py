"""Mimi's decoder as a stream: each frame decoded once, its history kept per request in slots.

Runs the weights of a transformers `MimiModel` (its modules' Linear, Conv and LayerNorm layers)
over one window of R frames per stream, in a layout that CUDA graphs can capture: state lives in
buffers preallocated for `n_slots` streams and indexed by a slot tensor, shapes depend on (Bd, R)
alone, and nothing reads a tensor back to the host.

The decode path and the state each stage keeps between windows (T = R frames at 12.5 Hz):
- quantizer: 32 codebook lookups summed per split, each split projected (1x1 conv) → [Bd, D, T];
  stateless.
- upsample: depthwise ConvTranspose (stride 2, kernel 4) to 25 Hz → [Bd, D, 2T]; keeps the
  `kernel - stride` output samples its last input has not finished (the pending overlap).
- transformer: layers of pre-norm attention + MLP with layer scales; keys and values of the last
  `sliding_window - 1 + PASS_STEPS` steps in a ring buffer per slot, step p at ring position
  p % ring, with the slot's step count giving RoPE positions and the ring's positions; a query at
  step q sees the keys at q - window < p <= q. A window's new keys and values are scattered into
  the ring in place, then each entry's ring is gathered once and masked by position (steps older
  than the window, or from before a fresh stream's start), so a fresh stream resets its step count
  alone. Windows of more than PASS_STEPS steps run the layers in passes of that many.
- SEANet: causal convs (each keeps its last `(kernel - 1) * dilation` input samples), ELUs,
  transposed convs (pending overlap as above) and residual blocks → [Bd, 1, T * 1920].

Each conv's history and pending overlap has a row past the slots that stays zero: a fresh entry
gathers from it, so a reset costs no pass over the state. The state is in the model's dtype.

Mimi's decoder is causal end to end, so streaming it this way gives the samples of
`MimiModel.decode` over the whole stream (tests/test_csm_mimi_stream.py holds it to 1e-4).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

PASS_STEPS = 4  # transformer steps (2 frames) a ring holds beyond the window's past: one pass's


class MimiStreamDecoder:
    """Streams a transformers `MimiModel`'s decoder: `init_streams`, then `decode_stream` per window."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        # transformers 5.2x holds the decode path in a MimiDecoderModel (`model.decoder`), earlier
        # versions on the MimiModel itself, with `model.decoder` the SEANet
        dec = model.decoder if hasattr(model.decoder, "decoder_seanet") else None
        upsample = model.upsample if dec is None else dec.upsample
        transformer = model.decoder_transformer if dec is None else dec.decoder_transformer
        self.model = model
        self.codebook_size = cfg.codebook_size
        self.window = cfg.sliding_window  # transformer steps a query sees, itself included
        self.upsample = upsample  # MimiConvTranspose1d, or None where the codes run at 25 Hz
        self.layers = list(transformer.layers)
        # one rotary table for the stack, or (transformers 4.4x) one per attention, all alike
        rotary = getattr(transformer, "rotary_emb", None) or self.layers[0].self_attn.rotary_emb
        self.inv_freq = rotary.inv_freq  # [head_dim / 2] float32
        self.seanet = list((model.decoder if dec is None else dec.decoder_seanet).layers)
        self.scaling = 1 / math.sqrt(cfg.head_dim)  # as MimiAttention scales its scores
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        if not cfg.use_causal_conv or cfg.trim_right_ratio != 1.0 or cfg.pad_mode != "constant":
            raise ValueError(
                "streaming needs Mimi's causal convolutions (use_causal_conv, trim_right_ratio 1)"
            )
        quant = model.quantizer
        self.splits = [quant.semantic_residual_vector_quantizer, quant.acoustic_residual_vector_quantizer]
        # per split, its codebooks' [codebook_size, codebook_dim] vectors: the tensors MimiModel's
        # own decode reads (the codebook's cached `embed`), no copy
        self.tables = [[vq.codebook.embed for vq in rvq.layers] for rvq in self.splits]
        self.n_slots = 0
        self.state: dict[nn.Module, torch.Tensor] = {}

    def init_streams(self, n_slots: int) -> None:
        """Allocate (zeroed) the state of `n_slots` streams on the model's device and dtype: each
        conv's [n_slots + 1, C, size] (the last row stays zero), the rings
        [layers, n_slots, kv_heads, window - 1 + PASS_STEPS, head_dim], the step counts [n_slots]."""
        dtype, device = self.tables[0][0].dtype, self.tables[0][0].device
        self.n_slots = n_slots
        self.state = {}
        for conv, length in self._stateful_convs():
            if length.size == 0:  # a kernel-1 conv sees its input alone
                continue
            channels = conv.conv.in_channels if length.kind == "context" else conv.conv.out_channels
            self.state[conv] = torch.zeros(n_slots + 1, channels, length.size, dtype=dtype, device=device)
        ring = self.window - 1 + PASS_STEPS
        shape = (len(self.layers), n_slots, self.num_kv_heads, ring, self.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.steps = torch.zeros(n_slots, dtype=torch.int64, device=device)  # transformer steps seen

    def state_bytes_per_slot(self) -> int:
        """Bytes of state one slot holds (KV ring, conv histories, pending overlaps, step count)."""
        rings = [self.keys[:, 0], self.values[:, 0], self.steps[0]]
        return sum(t[0].numel() * t.element_size() for t in self.state.values()) + sum(
            t.numel() * t.element_size() for t in rings
        )

    def _stateful_convs(self) -> list[tuple[nn.Module, _StateSize]]:
        convs = [] if self.upsample is None else [self.upsample]
        for layer in self.seanet:
            if type(layer).__name__ == "MimiResnetBlock":
                convs += [m for m in layer.block if type(m).__name__ == "MimiConv1d"]
            elif type(layer).__name__ in ("MimiConv1d", "MimiConvTranspose1d"):
                convs.append(layer)
        out = []
        for conv in convs:
            k, s, d = conv.conv.kernel_size[0], conv.conv.stride[0], conv.conv.dilation[0]
            if type(conv).__name__ == "MimiConvTranspose1d":
                if k % s:
                    raise ValueError(
                        "a transposed conv streams here when its kernel is a multiple of its stride"
                    )
                out.append((conv, _StateSize("pending", k - s)))
            elif s == 1:
                out.append((conv, _StateSize("context", (k - 1) * d)))
            else:
                raise ValueError("Mimi's decoder convolutions have stride 1; a strided one cannot stream")
        return out

    @torch.no_grad()
    def decode_stream(self, codes: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """codes [Bd, R, K] int64, slots [Bd] int64, fresh [Bd] bool → audio [Bd, R * 1920].

        Entry b continues the stream held in slot `slots[b]` (restarted first where `fresh[b]`) and
        leaves the slot advanced by R frames. Ids past the codebook (CSM's 2048..2050) decode as the
        last code. Graph-safe; entries of one call hold distinct slots, but for a shared scratch
        slot whose state nobody reads."""
        read = torch.where(fresh, self.n_slots, slots)  # the rows conv states come from
        x = self._dequantize(codes.clamp(0, self.codebook_size - 1))  # [Bd, D, R]
        if self.upsample is not None:
            x = self._conv_transpose(self.upsample, x, slots, read)  # [Bd, D, 2R]
        x = self._transformer(x.transpose(1, 2), slots, fresh).transpose(1, 2)
        for layer in self.seanet:
            kind = type(layer).__name__
            if kind == "MimiConv1d":
                x = self._conv(layer, x, slots, read)
            elif kind == "MimiConvTranspose1d":
                x = self._conv_transpose(layer, x, slots, read)
            elif kind == "MimiResnetBlock":
                x = self._resnet_block(layer, x, slots, read)
            else:  # ELU
                x = layer(x)
        return x[:, 0]

    def _dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [Bd, R, K] → latents [Bd, D, R]: per split, its codebooks' vectors summed in
        codebook order (as MimiModel sums them: the same rounding), projected by a 1x1 conv."""
        out, first = None, 0
        for rvq, tables in zip(self.splits, self.tables, strict=True):
            x = F.embedding(codes[..., first], tables[0])  # [Bd, R, dim]
            for j in range(1, len(tables)):
                x = x + F.embedding(codes[..., first + j], tables[j])
            x = x.transpose(1, 2)  # [Bd, dim, R]
            if rvq.output_proj is not None:
                x = rvq.output_proj(x)
            out = x if out is None else out + x
            first += len(tables)
        return out

    def _conv(
        self, conv: nn.Module, x: torch.Tensor, slots: torch.Tensor, read: torch.Tensor
    ) -> torch.Tensor:
        """A causal conv over [its kept input history (rows `read`), x]: x [Bd, C, L] → [Bd, C', L];
        the history's next rows go to `slots`."""
        history = self.state.get(conv)
        if history is None:  # kernel 1: no history
            return conv.conv(x)
        full = torch.cat([history.index_select(0, read), x], dim=2)
        history.index_copy_(0, slots, full[..., -history.shape[2] :])
        return conv.conv(full)

    def _conv_transpose(
        self, conv: nn.Module, x: torch.Tensor, slots: torch.Tensor, read: torch.Tensor
    ) -> torch.Tensor:
        """A causal transposed conv: x [Bd, C, L] → [Bd, C', L * stride]. Each input step spreads
        `kernel = m * stride` samples over m output blocks of `stride`; blocks past the L-th still
        await the next input's share: they become the slot's pending overlap, the first blocks'
        share of the last window's pending is added here.

        One matmul per window plus the overlap-add: at one frame per window, CPU's ConvTranspose
        kernel takes 58 ms on SEANet's first layer (1024 → 512, kernel 16) where the matmul takes 2."""
        c = conv.conv
        bd, _, length = x.shape
        stride, groups = c.stride[0], c.groups
        m = c.kernel_size[0] // stride
        weight = c.weight.view(groups, c.in_channels // groups, -1)  # [G, C/G, C'/G * k]
        taps = torch.matmul(x.view(bd, groups, -1, length).transpose(2, 3), weight)  # [Bd, G, L, C'/G*k]
        taps = taps.view(bd, groups, length, -1, m, stride).permute(0, 1, 3, 2, 4, 5)
        taps = taps.reshape(bd, c.out_channels, length, m, stride)  # [Bd, C', L, m, stride]
        y = taps[:, :, :, 0]  # [Bd, C', L, stride]
        if m > 1:
            y = F.pad(y, (0, 0, 0, m - 1))  # [Bd, C', L + m - 1, stride]
        for i in range(1, m):  # step t's i-th block lands on output block t + i
            y = y + F.pad(taps[:, :, :, i], (0, 0, i, m - 1 - i))
        y = y.flatten(2)  # [Bd, C', (L + m - 1) * stride]
        pending = self.state.get(conv)
        n = length * stride
        if pending is not None:  # y is this call's own tensor: the overlap adds in place
            y[..., : pending.shape[2]] += pending.index_select(0, read)
            pending.index_copy_(0, slots, y[..., n:])
        y = y[..., :n]
        return y if c.bias is None else y + c.bias[:, None]

    def _resnet_block(self, block: nn.Module, x: torch.Tensor, slots: torch.Tensor, read: torch.Tensor):
        h = x
        for layer in block.block:
            h = self._conv(layer, h, slots, read) if type(layer).__name__ == "MimiConv1d" else layer(h)
        return block.shortcut(x) + h  # Mimi's shortcut is the identity (use_conv_shortcut false)

    def _transformer(self, x: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """x [Bd, S, D] (S new steps) → [Bd, S, D], attending to the slot's ring of past keys; the
        layers run in passes of at most the ring's PASS_STEPS spare steps."""
        step = self.keys.shape[3] - (self.window - 1)
        start = torch.where(fresh, 0, self.steps.index_select(0, slots))  # [Bd] steps before x
        out = [
            self._transformer_pass(x[:, first : first + step], slots, start + first)
            for first in range(0, x.shape[1], step)
        ]
        self.steps.index_copy_(0, slots, start + x.shape[1])
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def _transformer_pass(self, x: torch.Tensor, slots: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """x [Bd, S, D] at steps start [Bd] + 0..S-1, S ≤ the ring's spare steps → [Bd, S, D]."""
        s, w, ring, dev = x.shape[1], self.window, self.keys.shape[3], x.device
        q_pos = start[:, None] + torch.arange(s, device=dev)  # [Bd, S]
        end = q_pos[:, -1:] + 1
        # once x's steps are in, ring entry i holds the step p < end, p ≡ i (mod ring), nearest
        # end; p < 0 is no step of this stream (zeros, or another stream's)
        k_pos = end - ring + torch.remainder(torch.arange(ring, device=dev) - end, ring)  # [Bd, ring]
        dist = q_pos[:, :, None] - k_pos[:, None, :]  # [Bd, S, ring]
        mask = ((dist >= 0) & (dist < w) & (k_pos >= 0)[:, None, :])[:, None]
        freqs = q_pos[..., None].float() * self.inv_freq.to(dev)  # [Bd, S, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [Bd, 1, S, head_dim]
        rope = (emb.cos().to(x.dtype), emb.sin().to(x.dtype), torch.remainder(q_pos, ring)[:, None], mask)
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + layer.self_attn_layer_scale(self._attention(layer.self_attn, h, i, slots, rope))
            x = x + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(x)))
        return x

    def _attention(self, attn, h: torch.Tensor, i: int, slots: torch.Tensor, rope: tuple) -> torch.Tensor:
        """h [Bd, S, D] → [Bd, S, D]: scatters the S new keys and values into layer i's rings (at
        rope's ring positions [Bd, 1, S]), then attends over each entry's ring (one gather)."""
        bd, s, _ = h.shape
        cos, sin, at, mask = rope
        q = attn.q_proj(h).view(bd, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(bd, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(h).view(bd, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)  # [Bd, H, S, hd]
        where = (slots[:, None, None], torch.arange(self.num_kv_heads, device=h.device)[:, None], at)
        self.keys[i].index_put_(where, k)
        self.values[i].index_put_(where, v)
        out = F.scaled_dot_product_attention(
            q,
            self.keys[i].index_select(0, slots),  # [Bd, Hkv, ring, hd]
            self.values[i].index_select(0, slots),
            attn_mask=mask,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return attn.o_proj(out.transpose(1, 2).reshape(bd, s, -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class _StateSize(NamedTuple):
    """What a conv keeps between windows: its input history ("context") or output overlap ("pending")."""

    kind: str
    size: int  # samples per channel
