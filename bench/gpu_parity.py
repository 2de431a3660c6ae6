"""GPU fidelity checks (run on the H200 with dummy Orpheus-3B weights, bf16).

1. Teacher-forced logits: the serving path (fused kernels + FlashInfer + CUDA graphs) against the
   eager reference path (unfused, HF arithmetic, torch paged attention) on the same GPU, and against
   the CPU torch backend in fp32 with the same weights.
2. Prefill graphs (bench/prefill_parity.py): logits and KV pages against eager FlashInfer prefill
   for several prompt lengths and request mixes, and steps mixing prefill and decode rows.
3. Greedy tokens of a request alone and inside batches of other requests (graphs on), and alone
   with graphs on vs off.
4. Codec graphs against the eager codec.

Writes JSON to --out and exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from bench.prefill_parity import TOLERANCE, compare, prefill_checks
from common.messages import Prompt, SamplingParams
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.engine import Engine, EngineLimits
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache
from gpu_worker.runner.model_runner import make_runner
from programs import get_spec, load_program_class
from programs.orpheus.model import LlamaLM

PAGE = 16


def forced_batches(seqs: list[np.ndarray], n_prompt: list[int]) -> list[StepBatch]:
    """Step 0 prefills every prompt; step t feeds each sequence's token at n_prompt + t - 1."""
    per = 1 + max(len(s) for s in seqs) // PAGE
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(seqs))]
    steps = []
    ids = np.concatenate([s[:n] for s, n in zip(seqs, n_prompt, strict=True)])[:, None]
    pos = np.concatenate([np.arange(n) for n in n_prompt])
    steps.append(StepBatch(ids, pos, [0, *np.cumsum(n_prompt).tolist()], list(n_prompt), tables, len(seqs)))
    for t in range(1, min(len(s) - n for s, n in zip(seqs, n_prompt, strict=True)) + 1):
        ids = np.array([[s[n + t - 1]] for s, n in zip(seqs, n_prompt, strict=True)], dtype=np.int64)
        pos = np.array([n + t - 1 for n in n_prompt], dtype=np.int64)
        steps.append(StepBatch(ids, pos, list(range(len(seqs) + 1)), [n + t for n in n_prompt], tables, 0))
    return steps


def run_forced(runner, steps: list[StepBatch]) -> torch.Tensor:
    return torch.stack([runner.forward(b)[0][:, 0].float().cpu() for b in steps])  # [T, B, V]


VARIANTS = {
    "default (no split-KV)": {},
    "split-KV allowed": {"no_split_kv": False},
}


def codec_graphs_vs_eager(program, tokens: np.ndarray, keys: np.ndarray, max_batch: int) -> dict:
    """Windows `tokens` [n, detok_interval, C] decoded by the codec graphs and eagerly, as regular
    windows and cut to every shorter kind the codec has graphs for (lead and start windows: their
    last rows): the largest PCM16 difference over all, per row count, and whether the valid flags
    agree."""
    from codec_worker.worker import Codec

    graphs, eager = Codec(program, max_batch=max_batch), Codec(program, max_batch=max_batch, graphs=False)
    per_rows, valid_equal = {}, True
    for rows, tail in sorted(graphs.graphs, reverse=True):
        if tail:
            continue  # tail windows: bench/codec_passes.py
        g = graphs.graphs[rows, tail]
        part = np.ascontiguousarray(tokens[: g.max_batch, -rows:])
        pg, vg = g.decode(part, keys[: len(part)])
        pe, ve = eager._decode_eager(part, keys[: len(part)])
        per_rows[rows] = int(np.abs(pg.astype(np.int32) - pe.astype(np.int32)).max())
        valid_equal &= bool((vg == ve).all())
    return {
        "max_pcm_diff": max(per_rows.values()),
        "max_pcm_diff_per_rows": per_rows,
        "valid_equal": valid_equal,
    }


def greedy_setup(program):
    """(prompt factory, engine factory) for the greedy checks: constrained greedy requests of
    `max_tokens` tokens each (or sampled, at a temperature with top-p 0.8), engines that keep every
    request's output."""

    def prompt(rid, text, seed, max_tokens=300, temperature=0.0):
        rows = program.preprocess(text, {}).astype("<i4")
        sp = SamplingParams(
            temperature=temperature, top_p=0.8, repetition_penalty=1.3, seed=seed, max_tokens=max_tokens
        )
        sp.constrained, sp.min_tokens = True, max_tokens
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    engines: dict[tuple, Engine] = {}

    def engine(**kw) -> Engine:
        """One engine per setting, reused once idle: its graphs are captured once, not per run."""
        key = tuple(sorted(kw.items()))
        if key not in engines:
            t0 = time.perf_counter()
            engines[key] = Engine(
                program,
                EngineLimits(max_batch_size=256, max_context=1200, **kw),
                progress=lambda msg: print(f"  [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True),
            )
        eng = engines[key]
        assert not eng.has_work()
        eng.outputs = {}
        return eng

    return prompt, engine


def greedy_batches(engine, prompt, kw: dict, temperature: float = 0.0) -> dict:
    """One greedy request alone, then among 3, 17, 40 and 160 others joining at different steps, and
    last of 4 arriving at once (prefilled in the same step as 3 others, in the 4th prefill lane).
    With a temperature, every request samples (its own seed): the same comparison for draws."""
    eng = engine(**kw)
    eng.add(prompt("x", "The same words, again.", 1, temperature=temperature))
    eng.run_until_idle()
    alone = eng.outputs["x"][0]
    out = {}
    for n_others in (3, 17, 40, 160):
        eng = engine(**kw)
        others = [
            prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 200 + 3 * i, temperature)
            for i in range(n_others)
        ]
        x = prompt("x", "The same words, again.", 1, temperature=temperature)
        order = [*others[: n_others // 2], x, *others[n_others // 2 :]]
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        got = eng.outputs["x"][0]
        first_diff = next((i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None)
        out[n_others] = {"tokens": len(alone), "first_difference": first_diff}
    eng = engine(**kw)
    for p in [*(prompt(f"o{i}", "other text " * (1 + i), 100 + i, 200, temperature) for i in range(3)),
              prompt("x", "The same words, again.", 1, temperature=temperature)]:  # fmt: skip
        eng.add(p)
    eng.run_until_idle()
    got = eng.outputs["x"][0]
    first_diff = next((i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None)
    out["3_same_step"] = {"tokens": len(alone), "first_difference": first_diff}
    return out


def greedy_graphs_vs_eager(engine, prompt) -> dict:
    """One greedy request alone with CUDA graphs on and off: informational (a padded prefill may
    round differently, and random-weight logits are nearly tied)."""
    out = {}
    for name, kw in (("graphs", {}), ("eager", {"cuda_graphs": False})):
        eng = engine(**kw)
        eng.add(prompt("x", "The same words, again.", 1))
        eng.run_until_idle()
        out[name] = eng.outputs["x"][0]
    a, b = out["graphs"], out["eager"]
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    return {
        "tokens": len(a),
        "first_difference": first if first is not None or len(a) == len(b) else min(len(a), len(b)),
    }


def parity_header() -> dict:
    """A parity run's results header; TF32 off, so bf16 GEMMs are compared as such."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return {
        "device": torch.cuda.get_device_name(),
        "model": "orpheus-3b dummy bf16",
        "date": time.strftime("%F"),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_parity.json")
    ap.add_argument("--cpu", action="store_true", help="also compare with the CPU fp32 torch backend")
    args = ap.parse_args()
    res = parity_header()
    ok = True
    spec = get_spec("orpheus")
    cls = load_program_class("orpheus")
    fast = cls(spec, load_format="dummy", device="cuda", dtype=torch.bfloat16)
    fast.load_lm()  # fused on CUDA
    ref = cls(spec, load_format="dummy", device="cuda", dtype=torch.bfloat16)
    ref.lm = LlamaLM.dummy(fast.lm.config, torch.bfloat16, "cuda")  # same seed → same weights, unfused
    assert fast.lm.fused and not ref.lm.fused

    rng = np.random.default_rng(0)
    prompts = [
        ref.preprocess(t, {}).reshape(-1)
        for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    seqs = [
        np.concatenate([p, rng.integers(128266, 128266 + 7 * 4096, size=48)]).astype(np.int64)
        for p in prompts
    ]
    n_prompt = [len(p) for p in prompts]
    steps = forced_batches(seqs, n_prompt)
    limits = EngineLimits(max_batch_size=8, max_context=1200)

    def kv(program):
        return allocate_kv_cache(
            program.num_layers, 64, PAGE, program.num_kv_heads, program.head_dim, torch.bfloat16, "cuda"
        )

    graph_logits = run_forced(make_runner(fast, kv(fast), limits), steps)
    eager_fast = run_forced(
        make_runner(fast, kv(fast), EngineLimits(max_batch_size=8, cuda_graphs=False)), steps
    )
    reference = run_forced(EagerRunner(ref, TorchPagedAttention(kv(ref), ref.num_qo_heads)), steps)
    res["graph_vs_eager_fused"] = compare(graph_logits, eager_fast)
    res["graph_vs_reference_bf16"] = compare(graph_logits, reference)
    # Bitwise before prefill graphs: a padded prefill rounds its bf16 GEMMs otherwise (TOLERANCE).
    ok &= res["graph_vs_eager_fused"]["max_abs"] < TOLERANCE
    ok &= res["graph_vs_reference_bf16"]["max_abs"] < 0.5
    if args.cpu:
        cpu = cls(spec, load_format="dummy", device="cpu", dtype=torch.float32)
        sd = {k: v.float().cpu() for k, v in ref.lm.state_dict().items()}
        cpu.lm = LlamaLM.from_state_dict(ref.lm.config, sd, torch.float32, "cpu")
        cpu_kv = allocate_kv_cache(
            cpu.num_layers, 64, PAGE, cpu.num_kv_heads, cpu.head_dim, torch.float32, "cpu"
        )
        cpu_logits = run_forced(EagerRunner(cpu, TorchPagedAttention(cpu_kv, cpu.num_qo_heads)), steps[:9])
        res["graph_vs_cpu_fp32"] = compare(graph_logits[:9], cpu_logits)
        res["reference_bf16_vs_cpu_fp32"] = compare(reference[:9], cpu_logits)
        # Random-weight logits are nearly tied everywhere, so bf16 rounding alone flips argmaxes
        # (the unfused bf16 reference agrees with fp32 no better); the bar is being as close to
        # fp32 as that reference is.
        ok &= res["graph_vs_cpu_fp32"]["max_abs"] <= 1.25 * res["reference_bf16_vs_cpu_fp32"]["max_abs"]
    print(json.dumps(res, indent=1), flush=True)
    del ref

    # 2. Prefill graphs against eager prefill: prompt mixes, then steps mixing prefill and decode.
    res["prefill_graphs"], prefill_ok = prefill_checks(fast, PAGE)
    ok &= prefill_ok

    # 3. Greedy tokens alone vs in batches (constrained, so the tokens are real audio codes).
    prompt, engine = greedy_setup(fast)
    batch_match = {}
    for name, kw in VARIANTS.items():
        batch_match[name] = greedy_batches(engine, prompt, kw)
        print(name, json.dumps(batch_match[name]), flush=True)

    res["greedy_alone_vs_batched"] = batch_match
    ok &= all(v["first_difference"] is None for v in batch_match["default (no split-KV)"].values())
    res["greedy_alone_graphs_vs_eager"] = greedy_graphs_vs_eager(engine, prompt)
    print("graphs vs eager, alone", res["greedy_alone_graphs_vs_eager"], flush=True)

    # 4. Codec graphs vs eager.
    torch.backends.cudnn.allow_tf32 = False
    fast.load_codec()
    codes = rng.integers(1, 4096, size=(40, 28))
    tokens = (codes + 128266 + 4096 * (np.arange(28) % 7)).astype(np.int64)[:, :, None]
    res["codec_graph_vs_eager"] = codec_graphs_vs_eager(fast, tokens, rng.integers(0, 2**62, size=40), 64)
    ok &= res["codec_graph_vs_eager"]["max_pcm_diff"] <= 1
    res["ok"] = bool(ok)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
