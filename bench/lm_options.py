"""GPU: what the LM options buy (H200, dummy Orpheus-3B): decode step time of the full engine step
(graph replay + plan + sampler) per batch size, for bf16 vs the audio-only head vs fp8 weights vs
an fp8 KV cache, as ratios against the first config measured in the same run; and each config's
teacher-forced logits (prefill through its own KV cache) against the first config's.

    voxpipe bench options --out lm_options.json [--configs bf16,bf16+fp8kv] [--sizes 1,64,256,384,512] [--ctx 512]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import torch

from bench.gpu_speed import cuda_ms
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.attention.flashinfer import FlashInferAttention
from gpu_worker.engine import Engine
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache, pages_for
from gpu_worker.runner.kv_cache import kv_cache_dtype as kv_dtype
from programs import get_spec, load_program_class

CONFIGS = {
    "bf16": {},
    "bf16+audio_head": {"lm_head": "audio"},
    # Without two host/GEMM measures, to weigh them: the audio head's rows unpadded (a row of
    # logits not 16-byte aligned) and FlashInfer's plan with Python's max over the batch's KV lengths.
    "audio_head_unpadded+py_max": {"lm_head": "audio", "undo_plan_max": True, "unpad_head": True},
    "fp8": {"quantization": "fp8"},
    "fp8+audio_head": {"quantization": "fp8", "lm_head": "audio"},
    "bf16+fp8kv": {"kv_cache_dtype": "fp8"},
    "audio_head+fp8kv": {"lm_head": "audio", "kv_cache_dtype": "fp8"},
    # an fp8 cache decodes on XQA by default (decode_attention auto): FlashInfer's fp8 paths apart
    "audio_head+fp8kv+flashinfer": {
        "lm_head": "audio",
        "kv_cache_dtype": "fp8",
        "decode_attention": "flashinfer",
    },
    "audio_head+xqa": {"lm_head": "audio", "decode_attention": "xqa"},
    "fp8+audio_head+fp8kv": {"quantization": "fp8", "lm_head": "audio", "kv_cache_dtype": "fp8"},
    "audio_head+fp8kv+cuda_cores": {
        "lm_head": "audio",
        "kv_cache_dtype": "fp8",
        "decode_tensor_cores": False,
        "decode_attention": "flashinfer",
    },
}


def load(**kw):
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, **kw)  # fmt: skip
    p.load_lm()
    return p


ENGINE_KEYS = (
    "kv_cache_dtype",
    "decode_tensor_cores",
    "decode_attention",
)  # GpuWorkerSettings settings; the rest build the program
UNDO_KEYS = ("undo_plan_max", "unpad_head")  # bench-only: measure the step as it was before a fix


def undo(program, undo_plan_max: bool = False, unpad_head: bool = False) -> None:
    """Put back what a fix changed, after the engine is built (building it installs the plan fix)."""
    if undo_plan_max:
        import builtins

        import flashinfer.decode
        import flashinfer.prefill

        flashinfer.decode.max = flashinfer.prefill.max = builtins.max
    if unpad_head:
        program._head_weight = program._head_weight[: len(program.head_ids)]


def fill_batch(eng: Engine, bs: int, ctx: int, tag: str = "") -> float:
    """Start `bs` constrained sampled requests that all stand near context `ctx` once admitted, and
    step until they are; → their mean context. The engine admits k new requests per step (the
    runner's `max_prefills_per_step`, 4 with graphs), so request i, admitted at step i // k, gets a
    prompt as many rows shorter than ctx as the steps left after it, and a budget that outlasts it."""
    top = eng.limits.max_context
    k = eng.runner.max_prefills_per_step or bs  # 0: no limit, all in the first step
    for i in range(bs):
        n = max(8, ctx - ((bs - 1) // k - i // k))
        rows = np.full(n, 128300, dtype="<i4")
        rows[0] = 128259
        sp = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=i, constrained=True)
        sp.max_tokens, sp.min_tokens = top, top - n
        eng.add(Prompt(f"{tag}r{i}", rows.tobytes(), n, sp))
    while eng.waiting or any(r.n_ctx == 0 for r in eng.running.values()):
        eng.step()  # admit and prefill everyone
    running = list(eng.running.values())
    assert len(running) == bs, f"batch {bs}: only {len(running)} running"
    return sum(r.n_ctx for r in running) / bs


def engine_steps(program, sizes: list[int], ctx: int, undo_kw: dict | None = None, **engine_kw) -> dict:
    """Full engine steps (sampling included) with every request decoding at context ~ctx."""
    out = {}
    bmax = max(sizes)
    limits = GpuWorkerSettings(
        max_batch_size=bmax,
        max_context=ctx + bmax + 300,
        first_chunk="reference",
        **engine_kw,
    )
    eng = Engine(program, limits)
    undo(program, **(undo_kw or {}))
    for bs in sizes:
        mean_ctx = fill_batch(eng, bs, ctx, f"b{bs}")
        for _ in range(3):
            eng.step()
        ms = cuda_ms(eng.step, 30)
        out[bs] = round(ms, 3)
        print(f"  batch {bs}: {ms:.2f} ms/step (mean context {mean_ctx:.0f})", flush=True)
        for rid in list(eng.running):
            eng.abort(rid)
        eng.run_until_idle()
    return out


def last_row_logits(program, prompts: list[np.ndarray], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Prefill logits of each prompt's last row (the prefill kernel reads keys/values back from the
    cache in its dtype)."""
    page = 16
    per = pages_for(max(map(len, prompts)) + 1, page)
    kv = allocate_kv_cache(program.num_layers, 1 + len(prompts) * per, page, program.num_kv_heads,
                           program.head_dim, kv_dtype(kv_cache_dtype, program.dtype), "cuda")  # fmt: skip
    runner = EagerRunner(program, FlashInferAttention(kv, program.num_qo_heads, program.dtype))
    lens = [len(p) for p in prompts]
    b = StepBatch(
        ids=np.concatenate(prompts)[:, None].astype(np.int64),
        pos=np.concatenate([np.arange(n) for n in lens]),
        qo_indptr=np.concatenate([[0], np.cumsum(lens)]).tolist(),
        kv_lens=lens,
        page_tables=[list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))],
        num_prefill=len(prompts),
    )
    return runner.forward(b)[0][:, 0].float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="lm_options.json")
    ap.add_argument("--sizes", default="1,64,256,384,512")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    res: dict = {"device": torch.cuda.get_device_name(), "model": "orpheus-3b dummy", "date": time.strftime("%F"),
                 "ctx": args.ctx, "step_ms": {}, "ratio_vs_base": {}}  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [rng.integers(128266, 128266 + 28672, size=n) for n in (40, 100, 180, 260, 333, 512)]
    ref_logits = None
    names = args.configs.split(",")
    base_name = names[0]
    res["baseline_config"] = base_name
    for name in names:
        print(name, flush=True)
        t0 = time.perf_counter()
        kw = dict(CONFIGS[name])
        engine_kw = {k: kw.pop(k) for k in ENGINE_KEYS if k in kw}
        undo_kw = {k: kw.pop(k) for k in UNDO_KEYS if k in kw}
        program = load(**kw)
        res.setdefault("load_s", {})[name] = round(time.perf_counter() - t0, 1)
        logits = last_row_logits(program, prompts, engine_kw.get("kv_cache_dtype", "auto"))
        if program.head_ids is not None:
            logits = torch.full((len(prompts), program.vocab_size), float("nan"), device="cuda").index_copy_(
                1, program.head_ids, logits
            )
        if name == base_name:
            ref_logits = logits
        elif ref_logits is not None:
            cols = program.head_ids if program.head_ids is not None else slice(None)
            a, b = logits[:, cols], ref_logits[:, cols]
            res.setdefault("logits_vs_base", {})[name] = {
                "max_abs": round((a - b).abs().max().item(), 4),
                "mean_abs": round((a - b).abs().mean().item(), 5),
                "ref_abs_max": round(b.abs().max().item(), 3),
                "argmax_agree": float((a.argmax(1) == b.argmax(1)).float().mean().item()),
            }
            print(f"  logits vs {base_name}:", res["logits_vs_base"][name], flush=True)
        res["step_ms"][name] = engine_steps(program, sizes, args.ctx, undo_kw, **engine_kw)
        base = res["step_ms"][base_name]
        res["ratio_vs_base"][name] = {b: round(res["step_ms"][name][b] / base[b], 3) for b in sizes}
        del program
        gc.collect()
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res["ratio_vs_base"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
