"""CSM on the GPU (run on the H200 with dummy csm-1b weights, bf16): graphs against eager.

1. Depth graphs: the captured `decode_tokens` (depth decoder + sampler) against the eager call, for
   the same backbone states, greedy and sampled, at several batch sizes: frames must be equal.
2. Backbone, teacher-forced: codebook-0 logits from the graph runner against the eager runner
   (FlashInfer both) over the same frames.
3. Greedy frames of a request alone and inside batches of 3 and 17 others joining at different
   steps, with graphs: the first frame that differs (None = identical).
4. Codec graphs (Mimi windows, pad-led first windows included) against the eager codec.
5. Decode step time with graphs (backbone + depth) per batch size, and the largest batch whose
   step stays under a frame (80 ms): an LM-side bound on real-time streams per GPU.

Writes JSON to --out and exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from bench.gpu_parity import codec_graphs_vs_eager
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine, EngineLimits
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.kv_cache import allocate_kv_cache
from gpu_worker.runner.model_runner import make_runner
from gpu_worker.runner.sampler import SamplingRows
from programs import get_spec, load_program_class

PAGE = 16
FRAME_MS = 80.0


def rows_for(n: int, temperature: float, seed: int) -> SamplingRows:
    f = dict(device="cuda")
    return SamplingRows(
        temperature=torch.full((n,), temperature, dtype=torch.float32, **f),
        top_k=torch.full((n,), 50, dtype=torch.int64, **f),
        top_p=torch.ones(n, dtype=torch.float32, **f),
        min_p=torch.zeros(n, dtype=torch.float32, **f),
        rep_penalty=torch.ones(n, dtype=torch.float32, **f),
        seed=torch.arange(seed, seed + n, dtype=torch.int64, **f),
        counter=torch.full((n,), 7, dtype=torch.int64, **f),
        history=None,
        block_stop=torch.zeros(n, dtype=torch.bool, **f),
    )


def forced_steps(prompts: list[np.ndarray], frames: np.ndarray) -> list[StepBatch]:
    """Step 0 prefills every prompt; step t feeds frame t-1 to every request."""
    n = len(prompts)
    per = 1 + (max(len(p) for p in prompts) + len(frames)) // PAGE
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]
    lens = [len(p) for p in prompts]
    ids = np.concatenate(prompts).astype(np.int64)
    pos = np.concatenate([np.arange(k) for k in lens])
    steps = [StepBatch(ids, pos, [0, *np.cumsum(lens).tolist()], list(lens), tables, n)]
    for t in range(1, len(frames) + 1):
        ids = np.repeat(frames[t - 1][None].astype(np.int64), n, axis=0)
        pos = np.array([k + t - 1 for k in lens], dtype=np.int64)
        steps.append(StepBatch(ids, pos, list(range(n + 1)), [k + t for k in lens], tables, 0))
    return steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="csm")
    ap.add_argument("--out", default="csm_gpu_parity.json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    spec = get_spec(args.model)
    prog = load_program_class(args.model)(spec, load_format="dummy", device="cuda", dtype=torch.bfloat16)
    prog.load_lm()
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "model": f"{args.model} dummy bf16",
        "date": time.strftime("%F"),
    }
    ok = True
    limits = EngineLimits(max_batch_size=64, max_context=1024)

    def kv():
        return allocate_kv_cache(
            prog.num_layers, 1 + 64 * 65, PAGE, prog.num_kv_heads, prog.head_dim, torch.bfloat16, "cuda"
        )

    # One engine (its GraphRunner captures prefill, decode and depth graphs once) serves every check.
    eng = Engine(prog, limits)
    graph_runner = eng.runner.forward_runner
    eager_runner = make_runner(prog, kv(), EngineLimits(cuda_graphs=False))

    # 1. Depth graphs vs eager.
    gen = torch.Generator(device="cuda").manual_seed(0)
    depth = {}
    for bs in (1, 3, 8, 64):
        hidden = torch.randn(bs, prog.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        c0 = torch.randint(0, 2048, (bs,), generator=gen, device="cuda")
        for temp in (0.0, 0.9):
            rows = rows_for(bs, temp, 100 * bs)
            g = graph_runner.decode_tokens(hidden, c0, rows).clone()
            e = eager_runner.decode_tokens(hidden, c0, rows)
            depth[f"batch {bs} temperature {temp}"] = int((g != e).sum())
    res["depth_graph_vs_eager_frames_differing_codes"] = depth
    ok &= all(v == 0 for v in depth.values())

    # 2. Backbone logits, teacher-forced.
    rng = np.random.default_rng(0)
    prompts = [
        prog.preprocess(t, {"voice": "0"})
        for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    frames = rng.integers(0, 2048, size=(32, 32))
    steps = forced_steps(prompts, frames)
    lg = torch.stack([graph_runner.forward(s)[0][:, 0].float().cpu() for s in steps])  # [T, B, V]
    le = torch.stack([eager_runner.forward(s)[0][:, 0].float().cpu() for s in steps])
    d = (lg - le).abs()
    res["backbone_graph_vs_eager"] = {
        "max_abs": float(d.max()),
        "ref_abs_max": float(le.abs().max()),
        "top1_agree": float((lg.argmax(-1) == le.argmax(-1)).float().mean()),
    }
    ok &= float(d.max()) < 1e-2
    print(json.dumps(res, indent=1), flush=True)

    # 3. Greedy frames alone vs batched (graphs on; min_tokens masks the stop code, so every
    # request runs its whole budget).
    def prompt(rid: str, text: str, seed: int, new: int = 60) -> Prompt:
        rows = prog.preprocess(text, {"voice": str(seed % 10)}).astype("<i4")
        sp = SamplingParams(temperature=0.0, seed=seed, max_tokens=len(rows) + new, min_tokens=new)
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    def generate(order: list[Prompt]) -> list:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        return eng.outputs["x"][0]

    alone = generate([prompt("x", "The same words, again.", 1)])
    batched = {}
    for n_others in (3, 17):
        others = [prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 40 + 3 * i) for i in range(n_others)]
        got = generate(
            [*others[: n_others // 2], prompt("x", "The same words, again.", 1), *others[n_others // 2 :]]
        )
        batched[n_others] = next((i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None)
    res["greedy_alone_vs_batched_first_difference"] = batched
    ok &= all(v is None for v in batched.values())

    # 4. Codec graphs vs eager.
    prog.load_codec()
    tokens = rng.integers(0, 2048, size=(16, prog.detok_interval, 32)).astype(np.int64)
    tokens[0, -1] = prog.pad_rows(1)[0]  # a stream's last window, padded past its end
    res["codec_graph_vs_eager"] = codec_graphs_vs_eager(prog, tokens, np.zeros(16, dtype=np.int64), 16)
    ok &= res["codec_graph_vs_eager"]["max_pcm_diff"] <= 1

    # 5. Decode step time (graphs): backbone replay + depth graph, per batch size.
    step_ms = {}
    for bs in (1, 8, 16, 32, 64):
        n_ctx = 300
        tables = [list(range(1 + i * 20, 1 + (i + 1) * 20)) for i in range(bs)]
        b = StepBatch(
            np.zeros((bs, 32), dtype=np.int64), np.full(bs, n_ctx, dtype=np.int64), list(range(bs + 1)),
            [n_ctx + 1] * bs, tables, 0,
        )  # fmt: skip
        rows = rows_for(bs, 0.9, 0)

        def one_step(b=b, rows=rows) -> None:
            logits, _, hidden = graph_runner.forward(b)
            graph_runner.decode_tokens(hidden, logits[:, 0].argmax(-1), rows)

        for _ in range(3):
            one_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            one_step()
        torch.cuda.synchronize()
        step_ms[bs] = (time.perf_counter() - t0) * 1000 / 20
    res["decode_step_ms_context_300"] = step_ms
    res["lm_bound_streams_real_time"] = max((bs for bs, ms in step_ms.items() if ms < FRAME_MS), default=0)
    res["ok"] = bool(ok)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
