"""The GPU tests' shared parts (dummy Orpheus-3B weights, bf16): teacher-forced steps, the greedy
request alone and among others, the codec graphs against the eager codec.

Used by test_gpu_parity.py, test_gpu_batch_invariance.py, test_gpu_xqa_parity.py,
test_gpu_csm_parity.py and the codec tests (a pass's time, the compiled codec).
"""

from __future__ import annotations

import gc
import time

import numpy as np
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.sampler import SamplingRows
from programs.base import Rows
from programs.blocks import fp8

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
    windows and cut to every shorter kind the codec has graphs for (lead windows: their last
    rows): the largest PCM16 difference over all, per row count, and whether the valid flags
    agree."""
    from codec_worker.worker import Codec

    graphs, eager = Codec(program, max_batch=max_batch), Codec(program, max_batch=max_batch, graphs=False)
    per_rows, valid_equal = {}, True
    for rows, tail in sorted(graphs.graphs, reverse=True):
        if tail:
            continue  # tail windows: test_gpu_codec_passes.py
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
        """The engine of this setting, reused while the runs keep to it (its graphs are captured
        once, not per run); another setting's engine is freed first. Each sizes its KV cache for
        its whole batch at the full context (~35 GB in bf16), so two or three alive at once would
        not fit an 80 GB GPU beside the weights. `invariant_gemm="on"` runs the GEMMs of plain
        weights in the row-invariant kernel, which is process-wide (`fp8.use_invariant_gemm`) as
        the gpu_worker sets it: the caller turns it off after its runs."""
        assert fp8.use_invariant_gemm(kw.get("invariant_gemm") == "on") == (kw.get("invariant_gemm") == "on")
        key = tuple(sorted(kw.items()))
        if key not in engines:
            engines.clear()
            gc.collect()
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info()
            # what an engine before it still holds shows here (its KV cache sizes to the free memory)
            print(f"  engine {dict(key)}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, "
                  f"{free / 2**30:.1f} GiB free before it", flush=True)  # fmt: skip
            t0 = time.perf_counter()
            engines[key] = Engine(
                program,
                GpuWorkerSettings(max_batch_size=256, max_context=1200, **kw),
                progress=lambda msg: print(f"  [{time.perf_counter() - t0:6.1f} s] {msg}", flush=True),
            )
        eng = engines[key]
        assert not eng.has_work()
        eng.outputs = {}
        return eng

    return prompt, engine


def greedy_batches(
    engine, prompt, kw: dict, temperature: float = 0.0, others: tuple[int, ...] = (3, 17, 40, 160)
) -> dict:
    """One greedy request alone, then among `others` others joining at different steps, and last of
    4 arriving at once (prefilled in the same step as 3 others, in the 4th prefill lane). With a
    temperature, every request samples (its own seed): the same comparison for draws."""
    eng = engine(**kw)
    eng.add(prompt("x", "The same words, again.", 1, temperature=temperature))
    eng.run_until_idle()
    alone = eng.outputs["x"][0]
    out = {}
    for n_others in others:
        eng = engine(**kw)
        rest = [
            prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 200 + 3 * i, temperature)
            for i in range(n_others)
        ]
        x = prompt("x", "The same words, again.", 1, temperature=temperature)
        order = [*rest[: n_others // 2], x, *rest[n_others // 2 :]]
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
        del eng  # freed with the factory's next setting
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


def rows_for(n: int, temperature: float, seed: int) -> SamplingRows:
    """Sampling settings of n depth-step rows: top-k 50, seeds seed.., 7 tokens sampled before."""
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


def where_for(n: int, n_codebooks: int) -> Rows:
    """Slots 0..n-1 at step 7, previous rows zero."""
    i64 = dict(dtype=torch.int64, device="cuda")
    return Rows(torch.arange(n, **i64), torch.full((n,), 7, **i64), torch.zeros(n, n_codebooks, **i64))


def decode_step_ms(engine, n_codebooks: int, sizes=(1, 8, 16, 32, 64), n_ctx: int = 300) -> dict[int, float]:
    """A decode step with graphs (backbone, then the depth step) per batch size, at context n_ctx."""
    runner, step_ms = engine.runner.forward_runner, {}
    for bs in sizes:
        tables = [list(range(1 + i * 20, 1 + (i + 1) * 20)) for i in range(bs)]
        b = StepBatch(
            np.zeros((bs, n_codebooks), dtype=np.int64), np.full(bs, n_ctx, dtype=np.int64), list(range(bs + 1)),
            [n_ctx + 1] * bs, tables, 0,
        )  # fmt: skip
        rows, where = rows_for(bs, 0.9, 0), where_for(bs, n_codebooks)

        def one_step(b=b, rows=rows, where=where) -> None:
            logits, _, hidden = runner.forward(b)
            runner.decode_tokens(hidden, logits[:, 0].argmax(-1), rows, where)

        for _ in range(3):
            one_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            one_step()
        torch.cuda.synchronize()
        step_ms[bs] = (time.perf_counter() - t0) * 1000 / 20
    return step_ms


def forced_steps(prompts: list[np.ndarray], rows: np.ndarray) -> list[StepBatch]:
    """Step 0 prefills every prompt; step t feeds row t-1 to every request (slot i, step t-1)."""
    n = len(prompts)
    per = 1 + (max(len(p) for p in prompts) + len(rows)) // PAGE
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]
    lens = [len(p) for p in prompts]
    ids = np.concatenate(prompts).astype(np.int64)
    pos = np.concatenate([np.arange(k) for k in lens])
    where = np.stack([np.repeat(np.arange(n), lens), np.concatenate([np.arange(-k, 0) for k in lens])], 1)
    steps = [StepBatch(ids, pos, [0, *np.cumsum(lens).tolist()], list(lens), tables, n, where=where)]
    for t in range(1, len(rows) + 1):
        ids = np.repeat(rows[t - 1][None].astype(np.int64), n, axis=0)
        pos = np.array([k + t - 1 for k in lens], dtype=np.int64)
        where = np.stack([np.arange(n), np.full(n, t - 1)], 1)
        steps.append(StepBatch(ids, pos, list(range(n + 1)), [k + t for k in lens], tables, 0, where=where))
    return steps


def bf16_engines(model: str, quantization: str = "none", fused: bool = False):
    """(program, Engine with graphs, eager runner over a KV cache of its own) for `model`'s dummy
    weights in bf16 on the GPU (`quantization` "fp8": its projections in float8; `fused`: as
    `--fused-step on` serves it, the layers fused and the sampler's Triton tail, which stays on for
    the process): what the per-model parity tests compare."""
    from gpu_worker.runner.kv_cache import allocate_kv_cache
    from gpu_worker.runner.model_runner import make_runner
    from programs import get_spec, load_program_class

    prog = load_program_class(model)(
        get_spec(model), load_format="dummy", device="cuda", dtype=torch.bfloat16, quantization=quantization
    )
    prog.load_lm()
    if fused:
        from gpu_worker.runner.sampler import use_tail_kernel

        assert prog.fuse_layers() and use_tail_kernel(True)
    kv = allocate_kv_cache(
        prog.num_layers, 1 + 64 * 65, PAGE, prog.num_kv_heads, prog.head_dim, torch.bfloat16, "cuda"
    )
    eng = Engine(prog, GpuWorkerSettings(max_batch_size=64, max_context=1024))
    return prog, eng, make_runner(prog, kv, GpuWorkerSettings(cuda_graphs=False))


def codec_pass_ms(codec, chunks, reps: int = 10) -> float:
    """A codec's decode of `chunks` (one pass), its mean wall time over `reps` after a warm one."""
    codec.decode(chunks)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        codec.decode(chunks)
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t0) / reps


def compiled_orpheus_codec(dtype: str):
    """Orpheus's program (dummy SNAC 24 kHz in `dtype`) on the GPU with its codec loaded, and the
    codec's compile backend; skips where there is none (no Triton)."""
    import pytest

    from codec_worker.worker import codec_compile_backend
    from programs import get_spec, load_program_class

    program = load_program_class("orpheus")(
        get_spec("orpheus"), load_format="dummy", device="cuda", codec_dtype=dtype
    )
    program.load_codec()
    backend = codec_compile_backend("auto", "cuda", program, True)
    if backend is None:
        pytest.skip("no Triton: no compiled codec on this GPU")
    return program, backend
