"""Which operation of a decode step makes a row's result depend on the batch it is in.

With bf16 weights a greedy request's tokens change among 160 others (decode bucket 192) and not
among 40 (bucket 48, tests/gpu/test_gpu_parity.py); this bench looks for the operation. For each one it
computes the same first row alone and inside batches of the decode buckets' sizes, with different
other rows, and reports the first batch size at which that row's output is no longer bit-identical
to its output alone (None: identical at every size):

- the GEMMs of an Orpheus-3B layer and the audio head, bf16 (`F.linear`), bf16 in tiles of 64 rows,
  bf16 in the row-invariant Triton kernel (`programs.blocks.invariant_gemm`, `--invariant-gemm`)
  and fp8 (`programs.blocks.fp8`, per-row activation scales, `torch._scaled_mm`); and the same
  GEMMs over a mixed step's rows (a prompt bucket's, then a decode bucket's) as one GEMM against
  one per part (`mixed_gemm`: the first such pair of sizes whose rows differ);
- decode attention over a paged cache: FlashInfer without split-KV (bf16 cache), XQA told one SM so
  that it never splits a request's keys (fp8 cache), as the engine runs them;
- the sampler's row-wise reductions over a row of probabilities (audio head, full vocabulary):
  softmax, torch's cumsum (on CUDA a single row takes another scan than rows of a batch, and a
  batch from some row count on another again), and the sampler's running sum (`fixed_mass`: the
  probabilities as integers of 2^-32, whose sum is exact in any order).

    voxpipe bench op-invariance --out op_invariance.json [--sizes 1,2,...,512]

On a GPU it also times each GEMM per way at a few row counts (`gemm_ms`: what invariance costs).
On a CPU (no FlashInfer) it checks the GEMMs only; `tests/test_op_invariance_bench.py` runs its
detector there. tests/gpu/test_gpu_op_invariance.py asserts, on the GPU, the ones the engine relies on.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpu_worker.runner.graphs import decode_buckets
from gpu_worker.runner.sampler import fixed_mass
from programs.blocks import fp8

HIDDEN, INTER, HQ, HKV, D, AUDIO_HEAD = 3072, 8192, 24, 8, 128, 4112
# (name, output features, input features): Orpheus-3B's fused projections and its audio-only head
GEMMS = (
    ("qkv", (HQ + 2 * HKV) * D, HIDDEN),
    ("o", HIDDEN, HQ * D),
    ("gate_up", 2 * INTER, HIDDEN),
    ("down", HIDDEN, INTER),
    ("audio_head", AUDIO_HEAD, HIDDEN),
)
PAGE, CTX = 16, 512
VOCABS = (("audio_head", AUDIO_HEAD + 1), ("full", 156940 + 1))  # + the sampler's sink column


def first_variant_size(
    op: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, sizes: list[int]
) -> int | None:
    """`op` maps [M, ...] inputs to [M, ...] outputs row by row (in exact arithmetic). → the first
    size in `sizes` at which row 0 of op(rows[:size]) differs, bit for bit, from op(rows[:1])[0],
    or None when it never does."""
    alone = op(rows[:1])[0]
    for m in sizes:
        if m > rows.shape[0]:
            break
        if not torch.equal(op(rows[:m])[0].view(torch.uint8), alone.view(torch.uint8)):
            return m
    return None


def invariant_gemm():
    """programs.blocks.invariant_gemm (Triton), imported where a GPU uses it."""
    from programs.blocks import invariant_gemm

    return invariant_gemm


def model_gemms(model: str) -> tuple[tuple[str, int, int], ...]:
    """(name, output features, input features) of a served model's backbone projections, from its
    shipped LM config (q/k/v fused as the GPU path fuses them, gate/up likewise)."""
    from programs import get_spec, load_program_class

    program = load_program_class(model)(get_spec(model), load_format="dummy")
    cfg = program.read_config("lm_config")
    cfg = cfg.get("text_config") or cfg.get("talker_config") or cfg  # Higgs's original layout, Qwen3-TTS
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq = cfg["num_attention_heads"]
    hkv = cfg.get("num_key_value_heads", hq)
    d = cfg.get("head_dim") or hidden // hq
    return (
        ("qkv", (hq + 2 * hkv) * d, hidden),
        ("o", hidden, hq * d),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
    )


def gemm_checks(device: str, sizes: list[int], shapes=GEMMS) -> dict:
    """Each GEMM's first batch-variant size, bf16, and fp8 on a GPU."""
    g = torch.Generator(device=device).manual_seed(0)
    out: dict = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(max(sizes), k, generator=g, device=device).to(torch.bfloat16)
        res = {"bf16": first_variant_size(lambda a, w=w: F.linear(a, w), x, sizes)}
        # in GEMMs of 64 rows each (fp8.tiled_linear, the heads' way): one shape at every row count
        res["bf16_tiled"] = first_variant_size(lambda a, w=w: fp8.tiled_linear(a, w), x, sizes)
        if device == "cuda":
            res["bf16_invariant"] = first_variant_size(lambda a, w=w: invariant_gemm().linear(a, w), x, sizes)
            q = fp8.Fp8Weight(w)
            res["fp8"] = first_variant_size(lambda a, q=q: fp8.linear(a, q), x, sizes)
            res["fp8_tiled"] = first_variant_size(lambda a, q=q: fp8.tiled_linear(a, q), x, sizes)
        out[name] = res
        print(name, res, flush=True)
    return out


def mixed_checks(device: str, sizes: list[int], prompt_rows=(32, 48, 64, 96, 128), shapes=GEMMS) -> dict:
    """A mixed step's GEMM (gpu_worker.runner.graphs: a prompt bucket's rows, then a decode bucket's):
    for each GEMM and weight kind, the first (prompt rows, decode rows) at which one GEMM over
    both parts differs, bit for bit, from a GEMM per part (null: never), which `fp8.rows_apart`
    runs for the weights that need it."""
    g = torch.Generator(device=device).manual_seed(1)
    out: dict = {}
    kinds = ("bf16", "fp8", "bf16_invariant") if device == "cuda" else ("bf16",)
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(max(prompt_rows) + max(sizes), k, generator=g, device=device).to(torch.bfloat16)
        ops = {"bf16": lambda a, w=w: fp8.linear(a, w)}
        if device == "cuda":
            q = fp8.Fp8Weight(w)
            ops["fp8"] = lambda a, q=q: fp8.linear(a, q)
            ops["bf16_invariant"] = lambda a, w=w: invariant_gemm().linear(a, w)
        res = {}
        for kind in kinds:
            op = ops[kind]
            first = None
            for r in prompt_rows:
                for bs in sizes:
                    whole = op(x[: r + bs])
                    parts = torch.cat([op(x[:r]), op(x[r : r + bs])])
                    if not torch.equal(whole.view(torch.uint8), parts.view(torch.uint8)):
                        first = [r, bs]
                        break
                if first is not None:
                    break
            res[kind] = first
        out[name] = res
        print("mixed", name, res, flush=True)
    return out


def gemm_times(sizes=(1, 16, 64, 128, 256, 384, 512, 2048, 8192), shapes=GEMMS, reps: int = 50) -> dict:
    """On a GPU, each GEMM's time (ms: `reps` calls captured in one CUDA graph, as the steps run
    them, replayed after a warm replay; CUDA events) at each row count (decode batches, and a
    prefill's rows), per way: bf16 as one GEMM (cuBLAS), bf16 in tiles of 64 rows
    (`--decode-row-tile 64`), bf16 in the row-invariant kernel (`--invariant-gemm on`) with the
    tile width it picks and with each other one (`bf16_invariant_n16` ...: what the pick leaves),
    and fp8."""
    g = torch.Generator(device="cuda").manual_seed(2)
    out: dict = {}
    for name, n, k in shapes:
        w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(torch.bfloat16)
        q = fp8.Fp8Weight(w)
        ways = {
            "bf16": lambda a, w=w: F.linear(a, w),
            "bf16_tiles_64": lambda a, w=w: fp8.tiled_linear(a, w),
            "bf16_invariant": lambda a, w=w: invariant_gemm().linear(a, w),
            **{
                f"bf16_invariant_n{bn}": lambda a, w=w, bn=bn: invariant_gemm().linear(a, w, tile_n=bn)
                for bn in (16, 32, 64, 128)
            },
            "fp8": lambda a, q=q: fp8.linear(a, q),
        }
        out[name] = {}
        for m in sizes:
            x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            row = {}
            n_calls = reps if m <= 512 else max(1, reps // 10)  # a prefill's outputs: fewer held at once
            for way, op in ways.items():
                op(x)  # compiles and picks kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(n_calls):
                        op(x)
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                row[way] = round(start.elapsed_time(end) / n_calls, 4)
                del graph
            out[name][m] = row
            print("ms", name, m, row, flush=True)
    return out


def sampling_checks(device: str, sizes: list[int], vocabs=VOCABS) -> dict:
    """The sampler's reductions along a row of probabilities (float32): each one's first
    batch-variant size, per vocabulary width."""
    g = torch.Generator(device=device).manual_seed(0)
    ops = {
        "softmax": lambda p: p.softmax(dim=-1),
        "cumsum": lambda p: p.cumsum(dim=-1),
        "fixed_mass_cumsum": lambda p: fixed_mass(p).cumsum(dim=-1),
    }
    out: dict = {}
    for name, v in vocabs:
        probs = torch.randn(max(sizes), v, generator=g, device=device).softmax(dim=-1)
        out[name] = {op: first_variant_size(f, probs, sizes) for op, f in ops.items()}
        print("sampling", name, out[name], flush=True)
    return out


def attention_checks(sizes: list[int]) -> dict:
    from bench.attention_kv import flashinfer_layer, xqa_layer
    from gpu_worker.attention.flashinfer import WORKSPACE_BYTES, import_flashinfer

    flashinfer = import_flashinfer()
    per = -(-(CTX + 1) // PAGE)
    pages = 1 + max(sizes) * per
    ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    sems = torch.zeros(8 << 20, dtype=torch.uint8, device="cuda")
    torch.manual_seed(0)
    q = torch.randn(max(sizes), HQ, D, dtype=torch.bfloat16, device="cuda")
    base = torch.randn(pages, 2, PAGE, HKV, D, device="cuda") * 2
    tables_all = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(max(sizes))]
    out = {}
    for name, dtype in (
        ("flashinfer, bf16 cache, no split-KV", torch.bfloat16),
        ("xqa, fp8 cache, 1 SM", fp8.FP8),
    ):
        cache = base.to(dtype)

        def op(rows: torch.Tensor, cache=cache, name=name) -> torch.Tensor:
            tables = tables_all[: rows.shape[0]]
            if name.startswith("xqa"):
                return xqa_layer(ws, sems, rows, cache, tables, CTX, 1)().clone()
            return flashinfer_layer(flashinfer, ws, rows, cache, tables, CTX, torch.bfloat16, True)().clone()

        out[name] = first_variant_size(op, q, sizes)
        print(name, out[name], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="op_invariance.json")
    ap.add_argument("--sizes", default="", help="comma list (default: the decode buckets to 512)")
    ap.add_argument(
        "--model",
        default="",
        help="the GEMM shapes of this model's backbone (default: Orpheus-3B's and its head)",
    )
    args = ap.parse_args(argv)
    shapes = model_gemms(args.model) if args.model else GEMMS
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else decode_buckets(512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "date": time.strftime("%F"),
        "what": "the first batch size at which row 0's output differs bit for bit from row 0 alone (null: never)",
        "sizes": sizes,
    }
    if device == "cuda":
        fp8.compile_quantizer(torch.device("cuda"), tuple(sorted({k for _, _, k in shapes})))
    res["model"] = args.model or "orpheus-3b"
    res["gemm"] = gemm_checks(device, sizes, shapes)
    res["mixed_gemm"] = mixed_checks(device, sizes, shapes=shapes)
    res["sampling"] = sampling_checks(device, sizes)
    if device == "cuda":
        res["attention"] = attention_checks(sizes)
        res["gemm_ms"] = gemm_times(shapes=shapes)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
