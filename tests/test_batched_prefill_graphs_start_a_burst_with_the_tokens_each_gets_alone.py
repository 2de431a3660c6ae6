"""Batched prefill graphs (gpu_worker/runner/batched_prefill.py): a step's prompts of one small
bucket share a forward pass, each in a segment of its own, the rest in lanes and the first with the
decode rows in a mixed graph; the step gives the eager runner's logits and KV pages, and through
the engine each request of a burst generates the tokens it generates alone. On CPU with the
stand-ins for FlashInfer and CUDA graphs of test_graph_runner_replays_match_eager_on_cpu (the
graphs exist for float8 weights, which only a GPU runs: enabled here by hand)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.engine import Engine
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.batched_prefill import Placement
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache, pages_for
from tests.conftest import tiny_lm_on_one_thread
from tests.test_graph_runner_replays_match_eager_on_cpu import (  # noqa: F401 (fixture)
    _capture,
    graph_runner_cls,
    program,
)

PAGE, MAX_CONTEXT = 16, 400


def batched_graphs(monkeypatch, how: str) -> bool:
    """Batched graphs on; their segments' attention in a wrapper each, or (where the backend plans
    segments as one: FlashInfer's FA2 over a float8 cache, a GPU's) in one wrapper per graph, or
    a wrapper each after all where the startup check finds other bits (`joined_keeps_bits`).
    → whether the graphs run one wrapper each."""
    monkeypatch.setattr("gpu_worker.runner.batched_prefill.capture", _capture)
    monkeypatch.setattr("gpu_worker.runner.graphs.batched_prefill_enabled", lambda *a: True)
    rule = how != "a wrapper a segment"
    monkeypatch.setattr(
        "gpu_worker.attention.flashinfer.FlashInferGraphs.segments_plan_as_one", lambda self, rows: rule
    )
    if how == "one wrapper refused at startup":
        monkeypatch.setattr("gpu_worker.runner.batched_prefill.joined_keeps_bits", lambda *a: False)
    return how == "one wrapper a graph"


@pytest.fixture(params=["a wrapper a segment", "one wrapper a graph"])
def batched(monkeypatch, request):
    return batched_graphs(monkeypatch, request.param)


@pytest.fixture(params=["a wrapper a segment", "one wrapper a graph", "one wrapper refused at startup"])
def batched_or_refused(monkeypatch, request):
    return batched_graphs(monkeypatch, request.param)


def test_a_steps_prompts_run_in_lanes_batched_and_mixed_graphs_as_eagerly(
    program,  # noqa: F811
    graph_runner_cls,  # noqa: F811
    batched_or_refused,
):
    batched = batched_or_refused
    n_seq, per = 12, pages_for(MAX_CONTEXT + 1, PAGE)
    shape = (program.num_layers, 1 + n_seq * per, PAGE, program.num_kv_heads, program.head_dim)
    kv_g = allocate_kv_cache(*shape, torch.float32, "cpu")
    kv_e = allocate_kv_cache(*shape, torch.float32, "cpu")
    limits = GpuWorkerSettings(max_batch_size=16, max_context=MAX_CONTEXT, max_prefills=3)
    graphs = graph_runner_cls(program, kv_g, limits)
    eager = EagerRunner(program, TorchPagedAttention(kv_e, program.num_qo_heads))
    buckets = [32, 48, 64, 96, 128]  # the prefill buckets of at most MIXED_PREFILL_ROWS rows
    assert sorted(graphs.batched.graphs) == [(k, r) for k in (2, 3) for r in buckets]
    assert sorted(graphs.batched.joined) == (sorted(graphs.batched.graphs) if batched else [])
    assert sorted(graphs.batched.wrappers) == ([] if batched else buckets)
    assert all(len(w) == 3 for w in graphs.batched.wrappers.values())
    # every mixed graph writes its decode rows' logits to the start of one buffer (one replays a step)
    shared, dec_logits = graphs._mixed_dec_logits, [out[2] for _, out in graphs.mixed.values()]
    assert len(dec_logits) > 10 and {t.data_ptr() for t in dec_logits} == {shared.data_ptr()}
    assert max(t.shape[0] for t in dec_logits) == shared.shape[0]
    replayed = []
    for key, (graph, _) in graphs.batched.graphs.items():
        graph.replay = lambda key=key, replay=graph.replay: replayed.append(key) or replay()
    # Step 0 (nothing decoding): 7 rows in lane 0; 20 and 25 (bucket 32) batched; 40 (bucket 48)
    # alone in its bucket: lane 1; 300 rows: lane 2. Step 2 (5 decoding): 10 rows with them in a
    # mixed graph, and 12 (its bucket, 32) joining it there; 15 and 30 batched in bucket 32, 50 and
    # 60 in bucket 64.
    lens = [7, 20, 25, 40, 300, 10, 12, 50, 15, 60, 30]
    joins = [0] * 5 + [2] * 6
    # 4 of bucket 32 beside the first: one joins it in a mixed graph and 3 share a batched graph,
    # but without decode rows (every stream sitting the step out) the 4 are more than one takes
    assert graphs.place([7, 20, 25, 28, 31]) == Placement(lanes=[0], groups={32: [2, 3, 4]}, joiners=[1])
    assert graphs.prompt_groups([7, 20, 25, 28, 31]) is None
    rng = np.random.default_rng(0)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per))[::-1] for i in range(n_seq)]
    seqs = [rng.integers(0, 1000, size=n + 10) for n in lens]
    last_rows = torch.zeros(n_seq, 1, dtype=torch.int64)
    for t in range(4):
        pre = [i for i in range(len(lens)) if joins[i] == t]
        dec = [i for i in range(len(lens)) if joins[i] < t]
        ids, pos, rows, kv_lens = [], [], [], []
        for i in pre:
            ids += seqs[i][: lens[i]].tolist()
            pos += list(range(lens[i]))
            rows.append(lens[i])
            kv_lens.append(lens[i])
        for i in dec:
            k = lens[i] + t - joins[i] - 1
            ids.append(0)
            last_rows[i, 0] = int(seqs[i][k])
            pos.append(k)
            rows.append(1)
            kv_lens.append(k + 1)
        order = pre + dec
        meta = np.array([order, [t - joins[i] for i in order], [lens[i] for i in order]], dtype=np.int64)
        b = StepBatch(np.array(ids, dtype=np.int64)[:, None], np.array(pos, dtype=np.int64),
                      [0, *np.cumsum(rows).tolist()], kv_lens, [tables[i] for i in order], len(pre), meta=meta,
                      last_rows=last_rows)  # fmt: skip
        # beside decode rows: lane 0 with 20 joining it, lanes 1 (25), 2 and 3; step 2: lane 0 with
        # 12 joining it, and the batched graphs of buckets 32 and 64
        assert graphs.prompt_groups([lens[i] for i in pre]) == {0: 4, 2: 3}.get(t, 0)
        got, got_meta, _ = graphs.forward(b)
        want, want_meta, _ = eager.forward(b)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {t}")
        assert got_meta.tolist() == want_meta.tolist()
        torch.testing.assert_close(kv_g[:, 1:], kv_e[:, 1:], rtol=1e-4, atol=1e-4, msg=f"step {t}")
    assert replayed == [(2, 32), (2, 64), (2, 32)]  # each step's in capture order: 64 rows first


@pytest.fixture(scope="module")
def tiny64():
    """orpheus-tiny in float64 with the audio head: a GEMM's rounding at another row count stays far
    below any sampling boundary (tests/test_streams_ahead_sit_out_slow_steps.py)."""
    yield from tiny_lm_on_one_thread("orpheus-tiny", dtype=torch.float64, lm_head="audio")


def test_a_burst_through_batched_graphs_samples_what_each_request_samples_alone(
    tiny64,
    graph_runner_cls,  # noqa: F811
    batched,
):
    limits = GpuWorkerSettings(max_batch_size=8, max_context=120, first_chunk="reference", max_prefills=4)
    texts = [
        "Hi.",
        "Hello there, how are you?",
        "Yes.",
        "No, not today.",
        "A sentence.",
        "Well.",
        "Go!",
        "Ok.",
    ]
    prompts = []
    for i, text in enumerate(texts):
        rows = np.asarray(tiny64.preprocess(text, {})).astype("<i4")
        sp = dict(temperature=0.0) if i % 2 else dict(temperature=0.9, top_k=50, seed=7 + i)
        prompts.append(
            Prompt(f"r{i}", rows.tobytes(), len(rows), SamplingParams(max_tokens=60, constrained=True, **sp))
        )

    def engine() -> Engine:
        eng = Engine(tiny64, limits)
        eng.runner.forward_runner = graph_runner_cls(tiny64, eng.kv_cache, limits)
        eng.outputs = {}
        return eng

    alone = {}
    for p in prompts:
        eng = engine()
        eng.add(p)
        eng.run_until_idle()
        alone |= eng.outputs
    eng = engine()
    replayed, runner = [], eng.runner.forward_runner
    for key, (graph, _) in [*runner.batched.graphs.items(), *runner.mixed.items()]:
        graph.replay = lambda key=key, replay=graph.replay: replayed.append(key) or replay()
    for p in prompts:
        eng.add(p)
    running = []
    while eng.waiting:
        eng.step()
        running.append(len(eng.running))
    # the first step's first prompt alone (nothing decodes), the others batched; the second's
    # first with the decode rows in a mixed graph, one joining it there, the other two batched
    assert running == [4, 8] and replayed == [(3, 32), (2, 32), (4, 32, 2)]
    eng.run_until_idle()
    assert eng.outputs == alone


def test_the_batched_graphs_follow_the_programs_weights_not_the_settings():
    """float8 weights are the program's (its loader quantizes them): a runner built with settings
    that do not repeat `--quantization` (a test's, a bench's) still batches their prompts, and bf16
    weights never do, whatever the settings say, but where their GEMMs run in the row-invariant
    kernel."""
    from gpu_worker.runner.batched_prefill import batched_prefill_enabled
    from programs import get_spec, load_program_class
    from programs.blocks import fp8 as fp8_gemms

    cls = load_program_class("orpheus")
    fp8, bf16 = cls(get_spec("orpheus"), quantization="fp8"), cls(get_spec("orpheus"))
    assert batched_prefill_enabled(fp8, GpuWorkerSettings())
    assert batched_prefill_enabled(fp8, GpuWorkerSettings(quantization="fp8"))
    assert not batched_prefill_enabled(fp8, GpuWorkerSettings(mixed_prefill=False))
    assert not batched_prefill_enabled(bf16, GpuWorkerSettings(quantization="fp8"))
    assert not batched_prefill_enabled(bf16, GpuWorkerSettings())
    try:  # bf16 weights whose GEMMs run in the row-invariant kernel (--invariant-gemm on)
        assert fp8_gemms.use_invariant_gemm(True)
        assert batched_prefill_enabled(bf16, GpuWorkerSettings())
        assert not batched_prefill_enabled(bf16, GpuWorkerSettings(mixed_prefill=False))
    finally:
        fp8_gemms.use_invariant_gemm(False)
    assert not batched_prefill_enabled(bf16, GpuWorkerSettings())


def test_admission_charges_a_prompt_joining_the_first_its_own_cost_and_a_new_group_its_pass(
    tiny64,
    graph_runner_cls,  # noqa: F811
    batched,
):
    """Streams running, and a fitted cost of 6 ms of decode, 0.5 ms a prompt and 3 ms a group of
    prompts run together: the 10.7 ms budget (0.88 of a 12.19 ms row) leaves 4.7 ms, so a step
    starts its first prompt (3.5 ms) and the one joining it in the mixed graph (0.5 ms), not a third
    of their bucket, which would open a group (3.5 ms); the next step starts it. (Without lead
    borrow: the budget alone.)"""
    limits = GpuWorkerSettings(max_batch_size=8, max_context=120, first_chunk="reference", lead_borrow=False)
    eng = Engine(tiny64, limits)
    eng.runner.forward_runner = graph_runner_cls(tiny64, eng.kv_cache, limits)
    s = eng.scheduler
    s.real_time = True  # paced as on a GPU
    prompts = []
    for i, text in enumerate(["Hello there, how are you?", "Hi.", "Yes.", "No."]):
        rows = np.asarray(tiny64.preprocess(text, {})).astype("<i4")
        sp = SamplingParams(max_tokens=60, min_tokens=50, constrained=True, temperature=0.0)
        prompts.append(Prompt(f"r{i}", rows.tobytes(), len(rows), sp))
    assert max(p.n_rows for p in prompts) <= 32  # one prompt bucket
    eng.add(prompts[0])
    eng.step()  # one stream running
    cost, rng = s.clock.cost, np.random.default_rng(0)
    cost.__init__()
    for _ in range(400):
        n = int(rng.integers(0, 4))
        groups = int(rng.integers(min(n, 1), n + 1))
        cost.add(
            int(rng.integers(1, 300)),
            int(rng.integers(0, 50_000)),
            n,
            0.006 + 0.0005 * n + 0.003 * groups,
            groups,
        )
    assert cost.coefficients() == pytest.approx((0.006, 0.0, 0.0, 0.0005, 0.003), abs=2e-5)
    for p in prompts[1:]:
        eng.add(p)
    assert eng.runner.prompt_groups([p.n_rows for p in prompts[1:3]]) == 1  # the second joins the first
    assert eng.runner.prompt_groups([p.n_rows for p in prompts[1:]]) == 2  # the third: a lane of its own
    eng.step()
    assert s.admitted_last == 2 and s.admitted_groups == 1 and s.admission_stops["room"] == 1
    eng.step()
    assert s.admitted_last == 1 and not eng.waiting


@pytest.mark.parametrize(
    "heads, head_dim, rows, cache, no_split_kv, joined",
    [
        ((24, 8), 128, 32, torch.float8_e4m3fn, True, True),  # Orpheus-3B: 31 x 3 = 93 packed rows
        ((24, 8), 128, 16, torch.float8_e4m3fn, True, False),  # 15 x 3 = 45: a tile of 64 alone
        ((16, 16), 64, 64, torch.float8_e4m3fn, True, False),  # 63 x 1: the same
        ((16, 16), 64, 128, torch.float8_e5m2, True, True),  # 127 x 1
        ((24, 8), 256, 128, torch.float8_e4m3fn, True, False),  # head dim 256: other tiles
        ((24, 8), 128, 32, torch.bfloat16, True, False),  # a 16-bit cache: FA3 on Hopper
        ((24, 8), 128, 32, torch.float8_e4m3fn, False, False),  # split KV: chunks by the plan
    ],
)
def test_segments_share_a_flashinfer_plan_only_where_each_keeps_its_query_tile(
    heads, head_dim, rows, cache, no_split_kv, joined
):
    """FlashInfer's FA2 kernel in graph plans takes query tiles of 128 rows past 64 packed query rows
    (rows x query heads per KV head) for the longest request the row total allows: a segment alone
    allows rows - 1, k segments more. Where the segment alone is past 64 the joined plan gives it the
    same tile (the GPU test, tests/gpu/test_gpu_batched_prefill_attention.py, holds the bits equal);
    elsewhere the segments keep a wrapper each."""
    from types import SimpleNamespace

    from gpu_worker.attention.flashinfer import FlashInferGraphs

    attn = object.__new__(FlashInferGraphs)  # the rule alone: no FlashInfer on a CPU install
    attn.program = SimpleNamespace(num_qo_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim)
    attn.kv_cache, attn.no_split_kv = torch.zeros(1, 1, 1, 1, 1, 1, dtype=cache), no_split_kv
    assert attn.segments_plan_as_one(rows) is joined


def test_the_startup_check_refuses_a_joined_plan_that_attends_otherwise(program, graph_runner_cls):  # noqa: F811
    """`joined_keeps_bits`: the backend's joined wrapper against a segment's own one, planned on
    random prompts over a scratch cache: equal with the stand-in wrappers (the same attention per
    entry); a joined wrapper whose rows differ, or that fails, is refused."""
    from gpu_worker.attention.flashinfer import FlashInferGraphs
    from gpu_worker.runner.batched_prefill import joined_keeps_bits, joined_layout
    from gpu_worker.runner.prefill_graphs import empty_prefill, max_prefill_pages, prefill_layout

    shape = (program.num_layers, 64, PAGE, program.num_kv_heads, program.head_dim)
    kv = allocate_kv_cache(*shape, torch.float32, "cpu")
    attn = FlashInferGraphs(program, kv, max_batch=8, max_pages=64, tensor_cores=True, no_split_kv=True)
    rows, k, pages = 32, 3, max_prefill_pages(32, 1, 64, PAGE)
    alone = prefill_layout(empty_prefill(program.n_codebooks), rows, 1, PAGE)
    single = attn.prepare_capture_prefill(rows, 1, pages, alone)
    joined = attn.prepare_capture_prefill(k * rows, 2 * k - 1, k * pages, joined_layout([alone] * k))
    assert joined_keeps_bits(program, kv, attn, rows, k, joined, single)
    run = joined.run
    joined.run = lambda q, cache: run(q, cache) * (1 + 1e-6)  # one rounding off
    assert not joined_keeps_bits(program, kv, attn, rows, k, joined, single)
    joined.run = lambda q, cache: run(q[:-1], cache)  # a plan that does not take every row
    assert not joined_keeps_bits(program, kv, attn, rows, k, joined, single)
