"""GPU: paged decode attention alone, per KV cache dtype (bf16, fp8 e4m3) and kernel: FlashInfer's
(tensor-core decode = FA2 prefill kernel, or the CUDA-core decode kernel; fp8 queries over an fp8
cache = FA3) and TensorRT-LLM's XQA as FlashInfer ships it (`xqa-*`: the generic kernel over a bf16
cache, the Hopper fp8 kernel over an fp8 one; `-split` lets it split a request's keys over several
blocks at small batches, as its default SM count does), at the Orpheus-3B shape (24 q heads, 8 kv
heads, head dim 128), for a whole step's 28 layers. Ratios against bf16 with tensor cores, measured
in the same run; each variant's largest difference from FlashInfer's output over the same cache
(`max_abs_diff_vs_flashinfer`).

    voxpipe bench attention --out attention_kv.json [--sizes 64,256,384,512] [--ctx 512]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench.gpu_speed import cuda_ms
from gpu_worker.attention.flashinfer import WORKSPACE_BYTES, import_flashinfer, page_arrays

LAYERS, HQ, HKV, D, PAGE = 28, 24, 8, 128, 16
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
# name → (query dtype, cache dtype, kernel). FlashInfer: tensor cores or not; fp8 queries over an
# fp8 cache is the one mix it runs on its FA3 (Hopper) kernels, output bf16. XQA: the SM count it
# is told (1: never split a request's keys, so a request reduces in the same order at any batch;
# 0: the device's, its default).
VARIANTS = {
    "bf16+tc": (BF16, BF16, ("flashinfer", True)),
    "bf16": (BF16, BF16, ("flashinfer", False)),
    "fp8+tc": (BF16, FP8, ("flashinfer", True)),
    "fp8": (BF16, FP8, ("flashinfer", False)),
    "fp8q+fp8+tc": (FP8, FP8, ("flashinfer", True)),
    "xqa-bf16": (BF16, BF16, ("xqa", 1)),
    "xqa-fp8": (BF16, FP8, ("xqa", 1)),
    "xqa-fp8-split": (BF16, FP8, ("xqa", 0)),
}


def graph_ms(fn, reps: int) -> float:
    """GPU time of `fn` replayed as a CUDA graph (host launch costs left out, as in the engine's
    captured steps); host-timed calls if it cannot be captured."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return cuda_ms(graph.replay, reps)
    except Exception as e:  # noqa: BLE001 - e.g. a wrapper that allocates on the host in run()
        print(f"  (not capturable: {type(e).__name__}: {str(e)[:120]}; timing eager calls)", flush=True)
        torch.cuda.synchronize()
        return cuda_ms(fn, reps)


def flashinfer_layer(flashinfer, ws, q, cache, tables, ctx, q_dtype, tensor_cores):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    indptr, indices, last = page_arrays([ctx] * len(tables), tables, PAGE)
    wrapper.plan(
        torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), HQ, HKV, D, PAGE,
        q_data_type=q_dtype, kv_data_type=cache.dtype, o_data_type=BF16, disable_split_kv=True,
    )  # fmt: skip
    qb = q.to(q_dtype)
    return lambda: wrapper.run(qb, cache)


def xqa_layer(ws, sems, q, cache, tables, ctx, sm_count):
    from flashinfer.xqa import xqa

    bs = len(tables)
    table = torch.tensor(tables, dtype=torch.int32, device="cuda")  # [bs, pages per request]
    seq_lens = torch.full((bs, 1), ctx, dtype=torch.int32, device="cuda").view(torch.uint32)
    out = torch.empty(bs, 1, HQ, D, dtype=BF16, device="cuda")
    k, v = cache.unbind(1)  # [P, page, Hkv, D] each, strided views of the interleaved pages
    q4 = q.unsqueeze(1)  # [bs, 1, Hq, D]
    sm = sm_count or torch.cuda.get_device_properties(0).multi_processor_count

    def run() -> torch.Tensor:
        xqa(q4, k, v, table, seq_lens, out, ws, sems, HKV, PAGE, sm_count=sm)
        return out[:, 0]

    return run


def main(argv: list[str] | None = None) -> int:
    flashinfer = import_flashinfer()  # with the plan fix the engine runs
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attention_kv.json")
    ap.add_argument("--sizes", default="64,256,384,512")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--variants", default="", help="comma list (default: all)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    per = -(-(args.ctx + 1) // PAGE)
    pages = 1 + max(sizes) * per
    res: dict = {"device": torch.cuda.get_device_name(), "date": time.strftime("%F"), "ctx": args.ctx,
                 "what": f"{LAYERS} layers of paged decode attention, one token per request, "
                         "replayed as a CUDA graph", "ms": {}, "max_abs_diff_vs_flashinfer": {}}  # fmt: skip
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    sems = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")  # XQA's semaphores: zero, self-resetting
    torch.manual_seed(0)
    q = torch.randn(max(sizes), HQ, D, dtype=BF16, device="cuda")
    wanted = args.variants.split(",") if args.variants else list(VARIANTS)
    caches: dict = {}
    for name in wanted:
        q_dtype, kv_dtype, (kernel, opt) = VARIANTS[name]
        if kv_dtype not in caches:
            caches[kv_dtype] = (torch.randn(pages, 2, PAGE, HKV, D, device="cuda") * 2).to(kv_dtype)
        cache = caches[kv_dtype]
        t0 = time.perf_counter()
        try:
            res["ms"][name] = {}
            for bs in sizes:
                tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(bs)]
                if kernel == "xqa":
                    layer = xqa_layer(ws, sems, q[:bs], cache, tables, args.ctx, opt)
                    # the same cache through FlashInfer (bf16 queries, tensor cores) as the yardstick
                    ref = flashinfer_layer(flashinfer, ws, q[:bs], cache, tables, args.ctx, BF16, True)()
                    diff = (layer().float() - ref.float()).abs().max().item()
                    res["max_abs_diff_vs_flashinfer"].setdefault(name, {})[bs] = round(diff, 5)
                else:
                    layer = flashinfer_layer(flashinfer, ws, q[:bs], cache, tables, args.ctx, q_dtype, opt)

                def step(layer=layer) -> None:
                    for _ in range(LAYERS):
                        layer()

                ms = graph_ms(step, 10)
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
            n: {b: round(v[b] / base[b], 3) for b in v if b in base} for n, v in res["ms"].items()
        }
    print(json.dumps(res.get("ratio_vs_bf16_tc")), flush=True)
    print(json.dumps(res["max_abs_diff_vs_flashinfer"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
