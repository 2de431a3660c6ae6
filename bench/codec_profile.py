"""Where a SNAC window's GPU time goes, and how much fusing its elementwise work saves.

At one batch size (default 128) of 4-frame windows, cropped decode (the codec_worker's default):
- the kernel time of one eager decode by kind (convolution, GEMM, elementwise, noise draw, copies),
  from the torch profiler, in µs per window;
- `graph`: the decode as the codec_worker runs it (one CUDA graph), µs per window, the baseline;
- `compiled_snake` (--snake): every Snake1d's forward replaced by `torch.compile` of the same expression
  (one fused elementwise kernel instead of five), then graphed;
- `compiled_taps`: `SnacCodec.compiled()`, what the codec_worker runs with `--codec-compile`: the
  cropped decode with depthwise convolutions as shifted sums, compiled once for every batch size;
- `compiled_taps_inlined`: the same with inductor's default inlining (a Snake recomputed per tap);
- `compiled_<mode>` (--compile-modes): `torch.compile` of the cropped decode without taps, graphed.
Then graph against compiled_taps at other batch sizes (--other-batches).
Each variant's kept samples are compared with the fp32 full-window decode (SNR, max |difference|).

Run: voxpipe bench codec-profile --out codec_profile.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import time
import types

import torch

from bench.codec_speed import CONFIG, compare, run_variant, windows
from programs.orpheus.codec import SnacCodec

KINDS = [  # (kind, pattern on the kernel name), first match wins
    ("fused (inductor)", r"^triton"),
    ("convolution", r"conv|implicit|wgrad|dgrad|fprop|xmma|cudnn|sm90_xmma"),
    ("gemm", r"gemm|nvjet|cutlass|ampere|sm80|sm90"),
    ("copy/cat/index", r"copy|cat|index|gather|scatter|slice|pad|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|sin"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def profile(decode, batch: int, reps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.no_grad():
        decode()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                decode()
            torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    kernels: list[tuple[str, float, int]] = []
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us <= 0:
            continue
        kind = kind_of(ev.key)
        kinds[kind] = kinds.get(kind, 0.0) + us
        kernels.append((ev.key[:90], us, ev.count))
    kernels.sort(key=lambda k: -k[1])
    per = reps * batch
    return {
        "us_per_window_by_kind": {
            k: round(v / per, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "kernels_per_decode": round(sum(c for _, _, c in kernels) / reps, 1),
        "top_kernels": [
            {"name": n, "us_per_window": round(us / per, 2), "calls_per_decode": c // reps}
            for n, us, c in kernels[:25]
        ],
    }


def snake_compiled(codec: SnacCodec) -> None:
    """Replace every Snake1d's forward by a compiled copy of SNAC's own expression."""
    from snac.layers import Snake1d

    @torch.compile(dynamic=True)
    def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)

    for m in codec.snac.decoder.modules():
        if isinstance(m, Snake1d):
            m.forward = types.MethodType(lambda self, x: snake(x, self.alpha), m)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument(
        "--compile-modes", default="", help="comma-separated torch.compile modes of the decode without taps"
    )
    ap.add_argument("--snake", action="store_true", help="also time compiled Snakes alone")
    ap.add_argument("--other-batches", default="1,16,64,256", help="batch sizes for graph vs compiled_taps")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "voxpipe bench codec-profile needs a CUDA GPU"
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = getattr(torch, args.dtype)
    tokens, keys = windows(args.batch)
    ref = SnacCodec.from_config(CONFIG, dtype=torch.float32, device="cuda", seed=0)
    with torch.no_grad():
        ref_audio = ref.decode_orpheus_window(tokens, keys, crop=False)[0].float()
    del ref
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "batch": args.batch,
        "dtype": args.dtype,
        "variants": {},
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def variant(name: str, codec: SnacCodec, fn=None, extra: dict | None = None) -> None:
        fn = fn or (lambda: codec.decode_orpheus_window(tokens, keys)[0])
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            us, audio = run_variant(fn, True)
            row = {"us_per_window": round(us / args.batch, 2), "first_call_s": round(first_s, 1)}
            row.update(compare(audio, ref_audio))
            row.update(extra or {})
        except Exception as e:  # one variant failing keeps the others
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        base = result["variants"].get("graph", {}).get("us_per_window")
        if base and "us_per_window" in row:
            row["x_graph"] = round(row["us_per_window"] / base, 3)
        result["variants"][name] = row
        print(name, row, flush=True)
        save()

    codec = SnacCodec.from_config(CONFIG, dtype=dtype, device="cuda", seed=0)
    result["profile_eager"] = profile(lambda: codec.decode_orpheus_window(tokens, keys)[0], args.batch)
    print(json.dumps(result["profile_eager"], indent=1), flush=True)
    variant("graph", codec)
    if args.snake:
        snaked = SnacCodec.from_config(CONFIG, dtype=dtype, device="cuda", seed=0)
        snake_compiled(snaked)
        variant("compiled_snake", snaked)
    # What the codec_worker runs with --codec-compile: one dynamic-batch compile, depthwise taps.
    fused = codec.compiled()
    variant("compiled_taps", codec, lambda: fused(tokens, keys)[0])
    result["profile_compiled_taps"] = profile(lambda: fused(tokens, keys)[0], args.batch)
    print(json.dumps(result["profile_compiled_taps"], indent=1), flush=True)
    # Inductor's own inlining (SnacCodec.compiled realizes reused values: REALIZE_REUSED).
    inlined = SnacCodec.from_config(CONFIG, dtype=dtype, device="cuda", seed=0).compiled(options={})
    variant("compiled_taps_inlined", codec, lambda: inlined(tokens, keys)[0])
    for mode in filter(None, args.compile_modes.split(",")):
        c = SnacCodec.from_config(CONFIG, dtype=dtype, device="cuda", seed=0)
        fn = torch.compile(lambda t, k, c=c: c.decode_orpheus_window(t, k)[0], mode=mode, dynamic=False)
        variant(f"compiled_{mode}", c, lambda fn=fn: fn(tokens, keys), {"mode": mode})
    # Other batch sizes: the graphed eager decode against the same dynamic compile (no recompile).
    result["by_batch"] = {}
    for batch in [int(b) for b in args.other_batches.split(",") if b]:
        t, k = windows(batch, seed=batch)
        row = {}
        for name, fn in (
            ("graph", lambda t=t, k=k: codec.decode_orpheus_window(t, k)[0]),
            ("compiled_taps", lambda t=t, k=k: fused(t, k)[0]),
        ):
            us, _ = run_variant(fn, True)
            row[name] = round(us / batch, 2)
        row["ratio"] = round(row["compiled_taps"] / row["graph"], 3)
        result["by_batch"][str(batch)] = row
        print("batch", batch, row, flush=True)
    save()


if __name__ == "__main__":
    main()
