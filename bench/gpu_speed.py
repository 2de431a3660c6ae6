"""GPU speed (H200, dummy Orpheus-3B, bf16): decode step per batch size, prefill step eager vs
graph, TTFA, offline throughput, and the Hugging Face `generate` + SNAC loop baseline measured in
the same run.

Writes one JSON (see --out) with `device`, `model`, `date`, `decode_step_ms`, `ttfa_p50_ms`,
`offline_x_realtime`, `baseline_x_realtime` and the details behind each.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import numpy as np
import torch

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.attention.flashinfer import FlashInferAttention
from gpu_worker.engine import Engine
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.graphs import GraphRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache, pages_for
from programs import get_spec, load_program_class
from programs.blocks import fp8
from tokenizer_worker.worker import wire_prompt

TOKENS_PER_SECOND = 82.03  # Orpheus tokens per second of audio
FLOORS_MS = {512: {1: 2.85, 8: 3.05, 64: 4.13, 128: 5.69, 256: 8.32, 384: 11.64, 512: 14.74}}
FLOORS_MS[1024] = {1: 2.91, 8: 3.23, 64: 5.38, 128: 8.18, 256: 12.45, 384: 17.70, 512: 22.71}


def cuda_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000 / reps


def decode_steps(
    program, sizes: list[int], contexts: list[int], row_tile: int | str = 0, label: str = ""
) -> dict:
    """Each batch size's decode step at each context, through the decode graphs; `row_tile` > 0 runs
    their backbone and head GEMMs in tiles of that many rows (`--decode-row-tile`), "invariant" in
    the row-invariant Triton GEMM (`--invariant-gemm on`)."""
    if row_tile == "invariant":
        assert fp8.use_invariant_gemm(True), "the invariant GEMM needs Triton"
        try:
            return decode_steps(program, sizes, contexts, 0, "invariant GEMM")
        finally:
            fp8.use_invariant_gemm(False)
    page = 16
    bmax = max(sizes)
    per = pages_for(max(contexts) + 1, page)
    kv = allocate_kv_cache(
        program.num_layers,
        1 + bmax * per,
        page,
        program.num_kv_heads,
        program.head_dim,
        torch.bfloat16,
        "cuda",
    )
    limits = GpuWorkerSettings(max_batch_size=bmax, max_context=max(contexts) + 1, decode_row_tile=row_tile)
    runner = GraphRunner(program, kv, limits)
    out: dict = {}
    for ctx in contexts:
        out[ctx] = {}
        for bs in sizes:
            tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(bs)]
            b = StepBatch(
                ids=np.full((bs, 1), 128300, dtype=np.int64),
                pos=np.full(bs, ctx - 1, dtype=np.int64),
                qo_indptr=list(range(bs + 1)),
                kv_lens=[ctx] * bs,
                page_tables=tables,
                num_prefill=0,
            )
            step_ms = cuda_ms(lambda b=b: runner.forward(b), 20)
            graph = runner.graphs[next(s for s in runner.sizes if s >= bs)][0]
            replay_ms = cuda_ms(graph.replay, 20)
            out[ctx][bs] = {
                "step_ms": round(step_ms, 3),
                "graph_only_ms": round(replay_ms, 3),
                "floor_ms": FLOORS_MS.get(ctx, {}).get(bs),
            }
            print(
                f"{label or f'row tile {row_tile}'} ctx {ctx} batch {bs}: step {step_ms:.2f} ms, graph {replay_ms:.2f} ms",
                flush=True,
            )
    return out


def prefill_steps(program, counts: list[int], rows: int) -> dict:
    """One step prefilling `count` prompts of `rows` rows: eager FlashInfer prefill vs the prefill
    graph (the whole `forward`, host work included), and the graph replay alone."""
    page, max_context = 16, 1200
    per = pages_for(max_context + 1, page)
    n = max(counts)
    kv = allocate_kv_cache(
        program.num_layers, 1 + n * per, page, program.num_kv_heads, program.head_dim, torch.bfloat16, "cuda"
    )
    graph = GraphRunner(program, kv, GpuWorkerSettings(max_batch_size=n, max_context=max_context))
    eager = EagerRunner(program, FlashInferAttention(kv, program.num_qo_heads, program.dtype))
    rng = np.random.default_rng(0)
    out: dict = {}
    for count in counts:
        b = StepBatch(
            ids=rng.integers(0, 128256, size=(count * rows, 1)).astype(np.int64),
            pos=np.tile(np.arange(rows, dtype=np.int64), count),
            qo_indptr=[i * rows for i in range(count + 1)],
            kv_lens=[rows] * count,
            page_tables=[list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(count)],
            num_prefill=count,
        )
        lay = graph.prefill.layout(b)
        eager_ms = cuda_ms(lambda b=b: eager.forward(b), 20)
        graph_ms = cuda_ms(lambda b=b: graph.forward(b), 20)
        replay_ms = cuda_ms(graph.prefill.graphs[lay.rows][0].replay, 20) if lay is not None else None
        out[count] = {
            "rows_each": rows,
            "bucket_rows": None if lay is None else lay.rows,
            "eager_ms": round(eager_ms, 3),
            "graph_ms": round(graph_ms, 3),
            "graph_only_ms": None if replay_ms is None else round(replay_ms, 3),
            "eager_over_graph": round(eager_ms / graph_ms, 2),
        }
        print(f"prefill {count} x {rows} rows: {out[count]}", flush=True)
    return out


def prompt(program, rid: str, text: str, seed: int, n_tokens: int) -> Prompt:
    """`text` as the tokenizer worker builds it (rows and per-request state), sampled with the
    model's defaults (constrained where it can be) to exactly `n_tokens` generated rows."""
    rows, state = wire_prompt(program.preprocess(text, {}))
    defaults = {k: v for k, v in program.spec.get("sampling", {}).items() if k != "min_tokens"}
    sp = SamplingParams(seed=seed, **defaults)
    sp.max_tokens, sp.min_tokens = len(rows) + n_tokens, n_tokens
    sp.constrained = program.can_constrain
    return Prompt(rid, rows.tobytes(), len(rows), sp, state=state)


def offline(
    program, codec: Codec, n_requests: int, n_tokens: int, max_batch: int, kv: str = "auto", gather: int = 0
) -> dict:
    """Every request at once; LM steps and codec batches alternate in one process (no overlap).
    `gather` > 0: windows wait until that many are pending (or the end), as the codec worker
    gathers them, so a codec call is one full batch instead of each step's few dozen windows."""
    eng = Engine(program, GpuWorkerSettings(max_batch_size=max_batch, max_context=1200, kv_cache_dtype=kv))
    for i in range(n_requests):
        eng.add(prompt(program, f"r{i}", f"Sentence number {i} to speak.", i, n_tokens))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    samples = calls = 0
    lm_s = codec_s = 0.0
    pending: list = []
    while eng.has_work() or pending:
        t1 = time.perf_counter()
        out = eng.step() if eng.has_work() else None
        t2 = time.perf_counter()
        lm_s += t2 - t1
        if out is not None:
            pending += out.chunks
        if pending and (len(pending) >= gather or not eng.has_work()):
            samples += sum(len(c.pcm) // 2 for c in codec.decode(pending))
            codec_s += time.perf_counter() - t2
            pending, calls = [], calls + 1
    wall = time.perf_counter() - t0
    audio_s = samples / 24000
    return {
        "requests": n_requests,
        "tokens_each": n_tokens,
        "wall_s": round(wall, 2),
        "lm_s": round(lm_s, 2),
        "codec_s": round(codec_s, 2),
        "codec_calls": calls,
        "codec_gather": gather,
        "audio_s": round(audio_s, 1),
        "x_realtime": round(audio_s / wall, 1),
        "tokens_per_s": round(n_requests * n_tokens / wall),
    }


def ttfa_in_process(program, codec: Codec, reps: int, kv: str = "auto") -> dict:
    """Server-side TTFA: prompt handed to the engine → first PCM chunk decoded (single stream)."""
    eng = Engine(program, GpuWorkerSettings(max_batch_size=8, max_context=1200, kv_cache_dtype=kv))
    times = []
    for i in range(reps):
        eng.add(prompt(program, f"t{i}", "Hello, how are you today?", 7 + i, 60))
        t0 = time.perf_counter()
        first = None
        while eng.has_work():
            out = eng.step()
            if first is None and out is not None and out.chunks:
                codec.decode(out.chunks[:1])
                first = time.perf_counter() - t0
        times.append(first * 1000)
    return {"p50_ms": round(statistics.median(times), 2), "all_ms": [round(t, 2) for t in times]}


def hf_baseline(n_tokens: int) -> dict:
    """The reference way: transformers generate (bf16, eager, KV cache) then SNAC on each
    28-token window every 7 tokens, one request at a time."""
    from snac import SNAC
    from transformers import LlamaConfig, LlamaForCausalLM

    from programs import get_spec, load_program_class

    program = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy")
    cfg = LlamaConfig(**program.read_config("lm_config"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    snac = (
        SNAC.from_config(__import__("os").path.join("programs/orpheus/configs", "snac_24khz.json"))
        .cuda()
        .eval()
    )
    ids = torch.tensor(
        [[128259, 128000, 9906, 11, 1268, 527, 499, 3432, 30, 128009, 128260, 128261, 128257]], device="cuda"
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, do_sample=True, top_p=0.8,
                             temperature=0.6, repetition_penalty=1.3, pad_token_id=128258)  # fmt: skip
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n_windows = (n_tokens - 28) // 7 + 1
    t1 = time.perf_counter()
    with torch.no_grad():
        for _ in range(n_windows):
            codes = [torch.from_numpy(rng.integers(0, 4096, size=(1, 4 * k))).cuda() for k in (1, 2, 4)]
            audio = snac.decode(codes)[:, :, 2048:4096].cpu()
    codec_s = time.perf_counter() - t1
    del model, audio
    torch.cuda.empty_cache()
    audio_s = n_windows * 2048 / 24000
    return {
        "tokens": int(out.shape[1] - ids.shape[1]),
        "generate_s": round(gen_s, 2),
        "generate_ms_per_token": round(gen_s * 1000 / n_tokens, 2),
        "snac_s": round(codec_s, 2),
        "x_realtime": round(audio_s / (gen_s + codec_s), 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_speed.json")
    ap.add_argument("--sizes", default="1,8,64,128,256,384,512")
    ap.add_argument("--offline-requests", type=int, default=256)
    ap.add_argument("--offline-tokens", type=int, default=1024)
    ap.add_argument("--baseline-tokens", type=int, default=200)
    ap.add_argument(
        "--decode-row-tiles",
        default="0",
        help="decode steps timed with each of these --decode-row-tile values (0: one GEMM a step; "
        "'invariant': one GEMM a step in the row-invariant kernel, --invariant-gemm on); "
        "decode_step_ms holds the first's, and with more than one decode_step_ms_by_row_tile each",
    )
    ap.add_argument("--prefill-counts", default="1,4,16", help="prompts per prefill step timed")
    ap.add_argument("--prefill-rows", type=int, default=40, help="rows of each prompt (Orpheus: ~20-60)")
    ap.add_argument(
        "--skip", default="", help="comma list of sections to skip: steps,prefill,ttfa,offline,baseline"
    )
    ap.add_argument("--lm-head", default="full", choices=("full", "audio"))
    ap.add_argument("--codec-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="for ttfa and offline")
    ap.add_argument("--codec-max-batch", type=int, default=256)
    ap.add_argument(
        "--offline-gather", type=int, default=256, help="windows pending per codec call (0: every step)"
    )
    args = ap.parse_args(argv)
    skip = set(args.skip.split(","))
    torch.backends.cudnn.allow_tf32 = False
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "model": "orpheus-3b dummy bf16",
        "date": time.strftime("%F"),
        "lm_head": args.lm_head,
        "codec_dtype": args.codec_dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    spec = get_spec("orpheus")
    program = load_program_class("orpheus")(
        spec, load_format="dummy", device="cuda", dtype=torch.bfloat16, lm_head=args.lm_head,
        codec_dtype=args.codec_dtype,
    )  # fmt: skip
    program.load_lm()
    program.load_codec()
    if "steps" not in skip:
        sizes = [int(s) for s in args.sizes.split(",")]
        tiles = [t if t == "invariant" else int(t) for t in args.decode_row_tiles.split(",")]
        by_tile = {}
        for tile in tiles:
            by_tile[tile] = decode_steps(program, sizes, [512, 1024], tile)
            gc.collect()  # the tile's graphs and KV cache, before the next tile's
            torch.cuda.empty_cache()
        res["decode_step_ms"] = by_tile[tiles[0]]
        if len(tiles) > 1:
            res["decode_step_ms_by_row_tile"] = by_tile
        save()
    if "prefill" not in skip:
        counts = [int(s) for s in args.prefill_counts.split(",")]
        res["prefill_step_ms"] = prefill_steps(program, counts, args.prefill_rows)
        torch.cuda.empty_cache()
        save()
    codec = Codec(program, max_batch=args.codec_max_batch, benchmark_graphs=True)  # as served by default
    if "ttfa" not in skip:
        res["ttfa_in_process"] = ttfa_in_process(program, codec, 10, args.kv_cache_dtype)
        res["ttfa_p50_ms"] = res["ttfa_in_process"]["p50_ms"]
        print("ttfa", res["ttfa_in_process"], flush=True)
        save()
    if "offline" not in skip:
        res["offline"] = offline(
            program,
            codec,
            args.offline_requests,
            args.offline_tokens,
            args.offline_requests,
            args.kv_cache_dtype,
            args.offline_gather,
        )
        res["offline_x_realtime"] = res["offline"]["x_realtime"]
        print("offline", res["offline"], flush=True)
        save()
    if "baseline" not in skip:
        del program, codec
        torch.cuda.empty_cache()
        res["baseline"] = hf_baseline(args.baseline_tokens)
        res["baseline_x_realtime"] = res["baseline"]["x_realtime"]
        if "offline_x_realtime" in res:
            res["speedup_vs_baseline"] = round(res["offline_x_realtime"] / res["baseline_x_realtime"], 1)
        print("baseline", res["baseline"], flush=True)
        save()
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
