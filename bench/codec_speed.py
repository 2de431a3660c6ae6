"""Codec speed (GPU): SNAC 24 kHz window decodes per batch size, every variant in one run.

Variants, each per batch size (µs per window and the ratio against the reference in this run):
- `reference_eager_fp32`: the unmodified `snac.SNAC.decode` (weight norm recomputed, global
  `torch.randn` noise) of the 4-frame window, samples [2048:4096] kept, eager;
- `graph_fp32_full`: our `SnacCodec` (weight norm folded, keyed noise) decoding the whole window,
  one CUDA graph per batch (what the codec_worker ran before cropping);
- `graph_{fp32,bf16,fp16}_crop`: the exact cropped decode (programs/orpheus/snac_crop.py) in a
  CUDA graph, the codec_worker's default in that dtype;
- `compiled_bf16_crop` (with --compile): `torch.compile` of the cropped bf16 decode, then graphed;
  its compile time is reported per batch.
Plus lead windows (7/14/21 rows, cropped fp32 graph, batch 1 and 16), and for every variant the SNR
(dB) and max |difference| of its kept samples against `graph_fp32_full` (the fp32 reference: equal
to `snac.SNAC.decode` fed the same noise, tests/test_snac_codec_parity.py). The reference eager
decode draws other noise, so it gets no SNR. TF32 stays off (as in the codec_worker) so fp32 is
exact. Results go to --out as JSON, rewritten after every batch size so a cut-short run keeps what
it measured.

Run: voxpipe bench codec --out codec_speed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time
from collections.abc import Callable

import torch

from programs.orpheus.codec import SnacCodec

CONFIG = os.path.join(os.path.dirname(__file__), "..", "programs", "orpheus", "configs", "snac_24khz.json")
WINDOWS_PER_S = 11.72  # a real-time Orpheus stream needs this many windows per second


def windows(batch: int, rows: int = 28, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid random windows [batch, rows, 1] int64 token ids and keys [batch] int64, on CUDA."""
    codes = torch.randint(0, 4096, (batch, rows), generator=torch.Generator().manual_seed(seed))
    tokens = (128266 + 4096 * (torch.arange(rows) % 7) + codes)[:, :, None]
    return tokens.cuda(), torch.arange(batch, dtype=torch.int64).cuda()


def time_us(fn: Callable[[], object], min_s: float = 0.3) -> float:
    """GPU time of fn in µs (CUDA events), repeated for about min_s after a warm-up."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(3, min(200, math.ceil(min_s * 1000 / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def graphed(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture fn (static inputs) in a CUDA graph → (replay, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def compare(audio: torch.Tensor, ref: torch.Tensor) -> dict:
    audio, ref = audio.float(), ref.float()
    err = (audio - ref).pow(2).sum(-1)
    snr = 10 * torch.log10(ref.pow(2).sum(-1) / err.clamp_min(1e-30))  # [B] dB per window
    return {
        "snr_db_min": round(float(snr.min()), 2),
        "snr_db_mean": round(float(snr.mean()), 2),
        "max_abs_diff": float((audio - ref).abs().max()),
    }


def run_variant(decode: Callable[[], torch.Tensor], graph: bool) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        if graph:
            replay, out = graphed(decode)
            us = time_us(replay)
            replay()
        else:
            us = time_us(decode)
            out = decode()
        torch.cuda.synchronize()
        return us, out.float().clone()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batches", default="16,64,256,512", help="comma-separated batch sizes")
    ap.add_argument(
        "--compile", action="store_true", help="also time torch.compile of the cropped bf16 decode"
    )
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--compile-batches", default="256", help="batch sizes to compile (each compiles anew)")
    ap.add_argument("--config", default=CONFIG, help="SNAC config JSON (random weights)")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "voxpipe bench codec needs a CUDA GPU"
    torch.backends.cudnn.allow_tf32 = False  # as the codec_worker: fp32 stays exact
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    batches = [int(b) for b in args.batches.split(",")]
    compile_batches = {int(b) for b in args.compile_batches.split(",")} if args.compile else set()

    reference = SnacCodec.dummy_snac(args.config, seed=0).cuda().eval()  # unmodified, weight norm live
    codecs = {
        name: SnacCodec.from_config(args.config, dtype=dtype, device="cuda", seed=0)
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    c32 = codecs["fp32"]
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": os.path.basename(args.config),
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "macs_per_window": {
            "full": c32.cropped.macs_by_stage(16, (0, 8192)),
            "crop": c32.cropped.macs_by_stage(16, (2048, 4096)),
        },
        "batches": {},
        "lead": {},
    }

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    save()
    for batch in batches:
        compile_mode = args.compile_mode if batch in compile_batches else None
        result["batches"][str(batch)] = bench_batch(batch, reference, codecs, compile_mode)
        save()
    for lead_rows in (7, 14, 21):
        for batch in (1, 16):
            tokens, keys = windows(batch, lead_rows, seed=1)
            try:
                us, audio = run_variant(lambda t=tokens, k=keys: c32.decode_orpheus_window(t, k)[0], True)
                with torch.no_grad():
                    full = c32.decode_orpheus_window(tokens, keys, crop=False)[0]
                row = {"us_per_window": round(us / batch, 2), "samples": audio.shape[-1]}
                row["max_abs_diff_vs_full"] = float((audio - full).abs().max())
            except Exception as e:
                row = {"error": f"{type(e).__name__}: {e}"}
            result["lead"][f"{lead_rows}x{batch}"] = row
            print("lead", lead_rows, batch, row, flush=True)
    save()
    print(json.dumps(result["batches"], indent=1))


def bench_batch(
    batch: int, reference: torch.nn.Module, codecs: dict[str, SnacCodec], compile_mode: str | None
) -> dict:
    """Every variant at one batch size → {variant: {us_per_window, speedup_vs_reference, snr...}}."""
    tokens, keys = windows(batch)
    c32 = codecs["fp32"]
    levels, _ = c32.window_levels(tokens)
    variants: list[tuple[str, Callable[[], torch.Tensor], bool]] = [
        ("reference_eager_fp32", lambda: reference.decode(levels)[:, 0, 2048:4096], False),
        ("graph_fp32_full", lambda: c32.decode_orpheus_window(tokens, keys, crop=False)[0], True),
    ]
    for name, codec in codecs.items():
        variants.append(
            (f"graph_{name}_crop", lambda c=codec: c.decode_orpheus_window(tokens, keys)[0], True)
        )
    rows: dict = {}
    ref_audio = None
    for name, decode, graph in variants:
        try:
            us, audio = run_variant(decode, graph)
            rows[name] = {"us_per_window": round(us / batch, 2), "ms_per_batch": round(us / 1000, 3)}
            if name == "graph_fp32_full":
                ref_audio = audio
            elif ref_audio is not None:
                rows[name].update(compare(audio, ref_audio))
        except Exception as e:  # one variant failing must not lose the others
            rows[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
        print(batch, name, rows[name], flush=True)
    if compile_mode is not None:
        rows["compiled_bf16_crop"] = compiled(codecs["bf16"], tokens, keys, compile_mode, ref_audio)
        print(batch, "compiled_bf16_crop", rows["compiled_bf16_crop"], flush=True)
    base = rows["reference_eager_fp32"].get("us_per_window")
    for row in rows.values():
        if base and "us_per_window" in row:
            row["speedup_vs_reference"] = round(base / row["us_per_window"], 3)
            row["gpu_ms_per_stream_second"] = round(row["us_per_window"] * WINDOWS_PER_S / 1000, 3)
    # One window alone equals it inside the batch (the cropped fp32 decode, eager here).
    with torch.no_grad():
        alone = c32.decode_orpheus_window(tokens[:1], keys[:1])[0]
        inside = c32.decode_orpheus_window(tokens, keys)[0][:1]
    rows["fp32_crop_alone_vs_batched_max_abs_diff"] = float((alone - inside).abs().max())
    return rows


def compiled(
    codec: SnacCodec, tokens: torch.Tensor, keys: torch.Tensor, mode: str, ref: torch.Tensor | None
) -> dict:
    """torch.compile of the cropped decode (one shape), then captured in a CUDA graph."""
    try:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        fn = torch.compile(lambda t, k: codec.decode_orpheus_window(t, k)[0], mode=mode, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(tokens, keys)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        us, audio = run_variant(lambda: fn(tokens, keys), True)
        row = {
            "us_per_window": round(us / len(tokens), 2),
            "ms_per_batch": round(us / 1000, 3),
            "compile_s": round(compile_s, 1),
            "mode": mode,
        }
        if ref is not None:
            row.update(compare(audio, ref))
        return row
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "mode": mode}


if __name__ == "__main__":
    main()
