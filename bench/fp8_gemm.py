"""FP8 against bf16 for the decode step's GEMMs alone (GPU): is `--quantization fp8` slow because of
its GEMMs or because of the work around them?

Per batch size M, the four GEMMs of one Llama-3.2-3B layer (QKV 3072→5120, O 3072→3072, gate/up
3072→16384, down 8192→3072), each captured in a CUDA graph and replayed, summed over 28 layers:
- `bf16`: F.linear;
- `fp8_rowwise`: `torch._scaled_mm` with per-row activation and per-channel weight scales (what
  programs/blocks/fp8.py runs), the activations already quantized;
- `fp8_tensorwise`: `torch._scaled_mm` with one scale each (cuBLAS's fp8 path), already quantized;
- `quantize`: programs/blocks/fp8.py's per-row activation quantizer (compiled when it can be) on the
  four inputs.
Ratios are against bf16 in the same run.

Run: python -m bench.fp8_gemm --out bench/results/fp8_gemm.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os

import torch
import torch.nn.functional as F

from bench.codec_speed import graphed, time_us
from programs.blocks import fp8

LAYERS = 28
SHAPES = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}  # (N, K)


def run_bf16(xs: dict, weights: dict, out: dict) -> None:
    for k, x in xs.items():
        out[k] = F.linear(x, weights[k])


def run_fp8(qs: dict, q_weights: dict, out: dict, one: torch.Tensor | None) -> None:
    """Row-wise scales, or (`one` given) a single scale each."""
    for k, (q, s) in qs.items():
        w = q_weights[k]
        a, b = (s, w.scale) if one is None else (one, one)
        out[k] = torch._scaled_mm(q, w.q.t(), scale_a=a, scale_b=b, out_dtype=torch.bfloat16)


def run_quantize(xs: dict) -> None:
    for x in xs.values():
        fp8._quantizer(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default="1,64,256,384,512")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench/fp8_gemm.py needs a CUDA GPU"
    dev = torch.device("cuda")
    compiled = fp8.compile_quantizer(dev, tuple(sorted({k for _, k in SHAPES.values()})))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {
        k: torch.randn(n, kk, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        for k, (n, kk) in SHAPES.items()
    }
    q_weights = {k: fp8.Fp8Weight(w) for k, w in weights.items()}
    one = torch.ones((), device=dev)
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "compiled_quantizer": compiled,
        "ms_per_step_28_layers": {},
        "ratio_vs_bf16": {},
        "max_rel_err_vs_bf16": {},
    }
    for m in [int(s) for s in args.sizes.split(",")]:
        xs = {
            k: torch.randn(m, kk, device=dev, dtype=torch.bfloat16, generator=gen)
            for k, (_, kk) in SHAPES.items()
        }
        qs = {k: fp8.quantize_rows(x) for k, x in xs.items()}
        outs: dict[str, dict[str, torch.Tensor]] = {"bf16": {}, "fp8_rowwise": {}, "fp8_tensorwise": {}}

        fns = {
            "bf16": functools.partial(run_bf16, xs, weights, outs["bf16"]),
            "fp8_rowwise": functools.partial(run_fp8, qs, q_weights, outs["fp8_rowwise"], None),
            "fp8_tensorwise": functools.partial(run_fp8, qs, q_weights, outs["fp8_tensorwise"], one),
            "quantize": functools.partial(run_quantize, xs),
        }
        row: dict[str, float] = {}
        for name, fn in fns.items():
            try:
                row[name] = round(time_us(graphed(fn)[0]) * LAYERS / 1000, 3)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:200]}"
        result["ms_per_step_28_layers"][str(m)] = row
        base = row["bf16"]
        result["ratio_vs_bf16"][str(m)] = {
            k: round(v / base, 3) for k, v in row.items() if isinstance(v, float)
        }
        errs = {}
        for k in SHAPES:
            ref = outs["bf16"].get(k)
            got = outs["fp8_rowwise"].get(k)
            if ref is not None and got is not None:
                errs[k] = round(float((got.float() - ref.float()).norm() / ref.float().norm()), 4)
        result["max_rel_err_vs_bf16"][str(m)] = errs
        print(m, row, result["ratio_vs_bf16"][str(m)], errs, flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
