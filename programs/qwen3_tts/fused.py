"""The code predictor's position step in one shape for every position, for torch.compile.

The eager step (`Qwen3TtsLM._predictor_position`) attends over positions 0..t through a cache
sliced to t + 1, so each of the 15 positions has shapes of its own, and each layer is some twenty
small kernels: a depth step of 15 positions is thousands of launches, which bound the decode step
on a GPU (7.6 ms of a 12.6 ms step at batch 1 on the H200, bench/results/h200-qwen3-tts-depth-compile.json). Here every position has the same shapes: a
local cache of all C slots, position t's keys and values blended in where a one-hot of t is set,
attention under a mask of the slots ≤ t, and t a device tensor. One compiled function (dynamic
batch) then serves every position, and Inductor fuses each layer's norms, RoPE, softmax and
activations into a few kernels between its GEMMs.

The arithmetic is the eager step's but for rounding: the softmax runs in float32 over the masked
slots (exact zeros beyond t), and fused kernels keep their intermediates in float32. Both the
captured graphs and the eager runner call it once it is on (`Qwen3TtsLM.compile_predictor`), so a
request's codes do not depend on which runs it, nor on its batch (every op is row-wise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from programs.blocks import fp8


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dim in float32, scaled by weight, in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def position_step(
    lm, x: torch.Tensor, t: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, Hp] one position's input, t a 0-dim int64 device tensor (the position), keys/values
    [L, B, Hkv, C, D] the local cache → (h [B, Hp] before the final norm, keys, values with slot t
    written)."""
    m = lm.code_predictor.model
    b, dh = x.shape[0], m.head_dim
    slots = keys.shape[3]
    at = t.reshape(1)  # index_select, not [t]: indexing by a tensor would read it on the host
    cos, sin = lm.predictor_cos.index_select(0, at)[0], lm.predictor_sin_signed.index_select(0, at)[0]
    here = torch.arange(slots, device=x.device) == t  # [C] the slot written
    seen = (torch.arange(slots, device=x.device) <= t)[None, None, None, :]  # [1, 1, 1, C]
    new_keys, new_values = [], []
    h = x
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        hq, hkv = a.num_heads, a.num_kv_heads
        ln = layer.input_layernorm
        qkv = fp8.linear(_rms(h, ln.weight, ln.eps), lm._qkv[i])  # [B, (Hq + 2 Hkv) D]
        q, k, v = qkv.split((hq * dh, hkv * dh, hkv * dh), dim=-1)
        q = _rms(q.view(b, hq, dh), a.q_norm.weight, a.q_norm.eps)
        k = _rms(k.view(b, hkv, dh), a.k_norm.weight, a.k_norm.eps)
        q = q * cos + q.roll(dh // 2, dims=-1) * sin
        k = k * cos + k.roll(dh // 2, dims=-1) * sin
        kc = torch.where(here[None, None, :, None], k[:, :, None, :], keys[i])  # [B, Hkv, C, D]
        vc = torch.where(here[None, None, :, None], v.view(b, hkv, dh)[:, :, None, :], values[i])
        new_keys.append(kc)
        new_values.append(vc)
        qg = q.view(b, hkv, hq // hkv, dh)  # [B, Hkv, G, D]: grouped queries share a key head
        scores = torch.matmul(qg, kc.transpose(-1, -2)).float() * dh**-0.5  # [B, Hkv, G, C]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1).to(vc.dtype)
        o = torch.matmul(probs, vc).reshape(b, hq * dh)  # [B, Hq D]
        h = h + a.o_proj(o)
        pn = layer.post_attention_layernorm
        gate, up = fp8.linear(_rms(h, pn.weight, pn.eps), lm._gate_up[i]).chunk(2, dim=-1)
        h = h + layer.mlp.down_proj(F.silu(gate) * up)
    return h, torch.stack(new_keys), torch.stack(new_values)
