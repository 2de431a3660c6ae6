"""GPU: FlashInfer paged decode attention alone, per KV cache dtype (bf16, fp8 e4m3) and kernel
(tensor-core decode = FA2 prefill kernel, or the CUDA-core decode kernel; fp8 queries over an fp8
cache = FA3), at the Orpheus-3B shape
(24 q heads, 8 kv heads, head dim 128), for a whole step's 28 layers. Ratios against bf16 with
tensor cores, measured in the same run.

    python -m bench.attention_kv --out attention_kv.json [--sizes 64,256,384,512] [--ctx 512]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.gpu_speed import cuda_ms
from gpu_worker.flashinfer_backend import WORKSPACE_BYTES, page_arrays

LAYERS, HQ, HKV, D, PAGE = 28, 24, 8, 128, 16


def main() -> int:
    import flashinfer

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_kv.json")
    ap.add_argument("--sizes", default="64,256,384,512")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--variants", default="", help="comma list (default: all)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    per = -(-(args.ctx + 1) // PAGE)
    pages = 1 + max(sizes) * per
    res: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%F"), "ctx": args.ctx,
                 "what": f"{LAYERS} layers of paged decode attention, one token per request", "ms": {}}  # fmt: skip
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    q = torch.randn(max(sizes), HQ, D, dtype=torch.bfloat16, device="cuda")
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    # name → (query dtype, cache dtype, tensor cores). fp8 queries over an fp8 cache is the one mix
    # FlashInfer runs on its FA3 (Hopper) kernels; its output stays bf16.
    variants = {
        "bf16+tc": (bf16, bf16, True),
        "bf16": (bf16, bf16, False),
        "fp8+tc": (bf16, fp8, True),
        "fp8": (bf16, fp8, False),
        "fp8q+fp8+tc": (fp8, fp8, True),
    }
    wanted = args.variants.split(",") if args.variants else list(variants)
    caches: dict = {}
    for name in wanted:
        q_dtype, kv_dtype, tc = variants[name]
        if kv_dtype not in caches:
            caches[kv_dtype] = (torch.randn(pages, 2, PAGE, HKV, D, device="cuda") * 2).to(kv_dtype)
        cache = caches[kv_dtype]
        t0 = time.perf_counter()
        try:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            res["ms"][name] = {}
            for bs in sizes:
                tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(bs)]
                indptr, indices, last = page_arrays([args.ctx] * bs, tables, PAGE)
                wrapper.plan(
                    torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), HQ, HKV, D, PAGE,
                    q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=bf16, disable_split_kv=True,
                )  # fmt: skip
                qb = q[:bs].to(q_dtype)

                def step(qb=qb, wrapper=wrapper, cache=cache) -> None:
                    for _ in range(LAYERS):
                        wrapper.run(qb, cache)

                ms = cuda_ms(step, 10)
                res["ms"][name][bs] = round(ms, 3)
                print(f"{name} batch {bs}: {ms:.3f} ms", flush=True)
        except Exception as e:  # a kernel this FlashInfer cannot build or run: say so, go on
            res.setdefault("failed", {})[name] = f"{type(e).__name__}: {e}"[:300]
            res["ms"].pop(name, None)
            print(f"{name}: {res['failed'][name]}", flush=True)
        res.setdefault("first_use_s", {})[name] = round(time.perf_counter() - t0, 1)  # JIT included
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    base = res["ms"].get("bf16+tc")
    if base:
        res["ratio_vs_bf16_tc"] = {
            n: {b: round(v[b] / base[b], 3) for b in sizes} for n, v in res["ms"].items()
        }
    print(json.dumps(res.get("ratio_vs_bf16_tc")), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
