"""Codec streams on the GPU: what a decode pass costs by entries and frames, as the codec_worker runs it.

For a program with codec streams (Qwen3-TTS, CSM, Higgs Audio v2; dummy weights of the real
config), the codec_worker's `DetokGraphs` (one graph per batch bucket, calls of `--call-batch`
entries on side streams), per variant:
- `graph`: the program's `detokenize` captured as served by default;
- `compiled` (where the program has `compiled_detokenize`): the same under torch.compile
  (`--codec-compile`), captured the same way; its compile time per window length is reported;
- either with `+cudnn-benchmark`: cuDNN picks each convolution shape's algorithm by timing them;
- `compiled+max-autotune`: the compiler times Triton templates against cuBLAS and cuDNN per shape.

For every window length R (frames an entry decodes: 1, or a merged window) and entries per pass N,
the wall time of a pass (host copy in, replay, copy out, read) in ms and per frame in µs, each
stream continuing from its last pass; each variant's audio against the float32 decode (graphed,
uncompiled) of the same streams from fresh (SNR, max |difference| in PCM16 steps); and a
torch.profiler count of one
pass's kernels by kind (R 1, N = --call-batch).

Run: voxpipe bench codec-streams --model qwen3-tts --out codec_streams.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time

import numpy as np
import torch
import torch._inductor.config as inductor_config

from bench.codec_profile import kind_of
from bench.provenance import command, commit
from codec_worker.graphs import DetokGraphs
from programs import get_spec, load_program_class


def _program(name: str, dtype: str):
    program = load_program_class(name)(get_spec(name), load_format="dummy", device="cuda", codec_dtype=dtype)
    program.load_codec()
    return program


def _codes(program, n: int, rows: int, seed: int) -> np.ndarray:
    size = getattr(program.codec, "codebook_size", 1024)
    rng = np.random.default_rng(seed)
    return rng.integers(0, size, (n, rows, program.n_codebooks)).astype(np.int64)


def _pass_ms(graphs: DetokGraphs, program, n: int, rows: int, reps: int) -> float:
    slots = np.arange(n, dtype=np.int64)
    fresh = np.zeros(n, bool)
    keys = np.zeros(n, np.int64)
    times = []
    for rep in range(reps + 2):
        codes = _codes(program, n, rows, rep)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphs.launch(codes, keys, slots, fresh).result()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[2:]))


def _audio(graphs: DetokGraphs, program, n: int, rows: int, passes: int = 3) -> np.ndarray:
    """n streams from fresh, `passes` windows each → PCM16 [n, passes * samples]."""
    slots = np.arange(n, dtype=np.int64)
    keys = np.zeros(n, np.int64)
    out = []
    for j in range(passes):
        pcm, _ = graphs.launch(_codes(program, n, rows, 100 + j), keys, slots, np.full(n, j == 0)).result()
        out.append(pcm.astype(np.int32))
    return np.concatenate(out, axis=1)


def _kernels(graphs: DetokGraphs, program, n: int, rows: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    slots, keys, fresh = np.arange(n, dtype=np.int64), np.zeros(n, np.int64), np.zeros(n, bool)
    codes = _codes(program, n, rows, 7)
    graphs.launch(codes, keys, slots, fresh).result()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs.launch(codes, keys, slots, fresh).result()
    kinds: dict[str, dict] = {}
    total_n, total_us = 0, 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or any(
            m in e.name.lower() for m in ("memcpy", "memset")
        ):
            continue
        k = kinds.setdefault(kind_of(e.name), {"kernels": 0, "us": 0.0})
        k["kernels"] += 1
        k["us"] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        total_n += 1
    for k in kinds.values():
        k["us"] = round(k["us"], 1)
        total_us += k["us"]
    return {"kernels": total_n, "kernel_us": round(total_us, 1), "by_kind": kinds}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="voxpipe bench codec-streams", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-tts")
    ap.add_argument("--out", required=True, help="JSON file to write (rewritten after each variant)")
    ap.add_argument("--dtype", default="float16", help="the codec's dtype (--codec-dtype)")
    ap.add_argument("--entries", default="1,4,16,32,64", help="entries per pass")
    ap.add_argument("--frames", default="1,2,4,8", help="window lengths R (1 and the program's merges)")
    ap.add_argument(
        "--call-batch", type=int, default=16, help="entries per detokenize call (--codec-call-batch)"
    )
    ap.add_argument("--variants", default="graph,compiled")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    os.environ.setdefault("TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT", "10000")  # every shape's plan kept
    entries = [int(x) for x in args.entries.split(",")]
    frames = [int(x) for x in args.frames.split(",")]
    res: dict = {
        "bench": "codec-streams",
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "commit": commit(),
        "command": command("voxpipe bench codec-streams", argv),
        "dtype": args.dtype,
        "call_batch": args.call_batch,
        "variants": {},
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    # the streams of the audio comparison decoded in float32 (graphed, uncompiled), first: each
    # variant's error against it
    torch.backends.cudnn.allow_tf32 = False
    program = _program(args.model, "float32")
    program.init_codec_streams(args.call_batch + 2)
    graphs = DetokGraphs(
        program, args.call_batch, rows=frames[0], scratch=args.call_batch + 1, call_batch=args.call_batch
    )
    ref = _audio(graphs, program, args.call_batch, frames[0]).astype(np.float64)
    del graphs, program
    gc.collect()

    def against_float32(pcm: np.ndarray) -> dict:
        a = pcm.astype(np.float64)
        snr = 10 * np.log10((ref**2).sum(-1) / np.maximum(((a - ref) ** 2).sum(-1), 1e-30))
        return {
            "max_pcm_diff": int(np.abs(a - ref).max()),
            "snr_db_min": round(float(snr.min()), 2),
            "snr_db_mean": round(float(snr.mean()), 2),
        }

    for variant in args.variants.split(","):
        # "+cudnn-benchmark": cuDNN times its algorithms for each convolution shape at the first
        # call (the warm-up before capture) and keeps the fastest
        torch.backends.cudnn.benchmark = "+cudnn-benchmark" in variant
        # "+max-autotune": inductor times Triton templates against cuBLAS/cuDNN for every GEMM and
        # convolution shape while compiling (slow to compile) and keeps the fastest
        inductor_config.max_autotune = "+max-autotune" in variant
        program = _program(args.model, args.dtype)  # its own stream state
        n_slots = max(entries) + 1
        program.init_codec_streams(n_slots + 1)
        fn = None
        if variant.startswith("compiled"):
            fn = program.compiled_detokenize("inductor")
            if fn is None:
                continue
        out = res["variants"].setdefault(variant, {"passes": {}, "capture_s": {}})
        for rows in frames:
            t0 = time.perf_counter()
            # a memory pool of its own, freed (below) before the next window length's graphs
            graphs = DetokGraphs(
                program,
                max(entries),
                rows=rows,
                detokenize=fn,
                scratch=n_slots,
                call_batch=args.call_batch,
            )
            out["capture_s"][rows] = round(time.perf_counter() - t0, 1)
            for n in entries:
                ms = _pass_ms(graphs, program, n, rows, args.reps)
                out["passes"][f"R{rows} N{n}"] = {
                    "ms": round(ms, 3),
                    "us_per_frame": round(1e3 * ms / (n * rows), 1),
                }
                print(
                    variant,
                    f"R={rows} N={n}: {ms:.2f} ms a pass, {1e3 * ms / (n * rows):.1f} us a frame",
                    flush=True,
                )
            if rows == frames[0]:
                out[f"kernels_R{rows}_N{args.call_batch}"] = _kernels(graphs, program, args.call_batch, rows)
                out["against_float32"] = against_float32(_audio(graphs, program, args.call_batch, rows))
                print(variant, "against float32:", out["against_float32"], flush=True)
            save()
            del graphs
            gc.collect()  # the graphs' default detokenize refers back to them
    save()


if __name__ == "__main__":
    main()
