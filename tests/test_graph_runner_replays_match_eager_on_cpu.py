"""`GraphRunner` (prefill graphs per row bucket, decode graphs per batch size, one input arena)
gives the eager runner's logits and KV pages, run on CPU against a stand-in for FlashInfer.

The stand-in keeps the contract a CUDA graph relies on: a wrapper built with `use_cuda_graph` has
fixed buffers and a fixed batch size, `plan` only refills those buffers (and refuses more rows than
its first plan), `run` reads nothing but the buffers; a "graph" replays its captured function into
the output tensor it returned at capture, reading the arena's device views. So the arena layout,
the padding, the order plan → copy → replay and the prefill/decode split are checked here; the
FlashInfer kernels themselves only on the GPU (tests/gpu/test_gpu_parity.py).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.config import GpuWorkerSettings
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache, pages_for
from programs import get_spec, load_program_class
from programs.base import LMProgram

PAGE = 16
MAX_CONTEXT = 400


class _Wrapper:
    """FlashInfer's paged wrappers as far as the runtime uses them (NHD, causal, GQA)."""

    decode = False

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False, **bufs) -> None:
        self.graph = use_cuda_graph
        self.qo = bufs.get("qo_indptr_buf")
        self.kvp = bufs.get("paged_kv_indptr_buf", bufs.get("paged_kv_indptr_buffer"))
        self.idx = bufs.get("paged_kv_indices_buf", bufs.get("paged_kv_indices_buffer"))
        self.last = bufs.get("paged_kv_last_page_len_buf", bufs.get("paged_kv_last_page_len_buffer"))
        self.max_rows = None
        # FlashInfer's page-locked tile table: torch.empty, so what a reused pinned block held
        self._pin_memory_int_workspace_buffer = torch.full((64,), 7, dtype=torch.uint8)

    def plan(self, *args, **kw) -> None:
        qo, kvp, idx, last = (None, *args[:3]) if self.decode else args[:4]
        n = len(kvp) - 1
        qo = torch.arange(n + 1, dtype=torch.int32) if qo is None else qo
        if not self.graph:
            self.qo, self.kvp, self.idx, self.last = qo.clone(), kvp.clone(), idx.clone(), last.clone()
            return
        assert n == len(self.kvp) - 1, "cuda-graph wrappers keep their batch size"
        # A graph plan leaves the table's entries past its tiles as they were: zeroed first
        # (`zero_tile_table`), those CTAs compute a tile of the plan's own again.
        assert not self._pin_memory_int_workspace_buffer.any(), (
            "a graph wrapper planned over a dirty tile table"
        )
        self.max_rows = self.max_rows or int(qo[-1])
        assert int(qo[-1]) <= self.max_rows, "more rows than the first plan"
        if self.qo is not None:
            self.qo.copy_(qo)
        self.kvp.copy_(kvp)
        self.last.copy_(last)
        self.idx[: len(idx)].copy_(idx)

    def run(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        qo = torch.arange(len(self.kvp), dtype=torch.int32) if self.decode else self.qo
        assert q.shape[0] == int(qo[-1])
        out = torch.zeros_like(q)
        group = q.shape[1] // cache.shape[3]
        for b in range(len(self.kvp) - 1):
            pages = self.idx[int(self.kvp[b]) : int(self.kvp[b + 1])].long()
            n_kv = (len(pages) - 1) * cache.shape[2] + int(self.last[b])
            kv = cache[pages]  # [pages, 2, page, Hkv, D]
            keys = kv[:, 0].reshape(-1, *kv.shape[-2:])[:n_kv].repeat_interleave(group, 1).transpose(0, 1)
            vals = kv[:, 1].reshape(-1, *kv.shape[-2:])[:n_kv].repeat_interleave(group, 1).transpose(0, 1)
            lo, hi = int(qo[b]), int(qo[b + 1])
            q_pos = torch.arange(n_kv - (hi - lo), n_kv)
            mask = torch.arange(n_kv)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1), keys, vals, attn_mask=mask)
            out[lo:hi] = o.transpose(0, 1)
        return out


class _Decode(_Wrapper):
    decode = True


def _holds_tensors(value) -> bool:
    """A tensor, or a plain object holding tensors (a program's per-request state), not a module."""
    if isinstance(value, torch.Tensor):
        return True
    fields = getattr(value, "__dict__", None)
    return (
        not isinstance(value, torch.nn.Module)
        and bool(fields)
        and any(isinstance(v, torch.Tensor) for v in fields.values())
    )


def _programs(step) -> list[LMProgram]:
    """The programs a captured step calls: in its closure, or as the `program` of an object there
    (a runner's `self`, a bound method's owner)."""
    found: dict[int, LMProgram] = {}
    for cell in step.__closure__ or ():
        value = cell.cell_contents
        for v in (value, getattr(value, "__self__", None)):
            p = v if isinstance(v, LMProgram) else getattr(v, "program", None)
            if isinstance(p, LMProgram):
                found[id(p)] = p
    return list(found.values())


class _Graph:
    """A captured step: `replay` runs it again into the output tensors it returned at capture. As a
    CUDA graph's kernels read the addresses they were captured with, the step reads its programs'
    tensors (weights, per-request state) as they were bound at capture, whatever the program holds
    now (a buffer a later `init_state` allocated in its place goes unread)."""

    def __init__(self, step, out) -> None:
        self.step, self.out = step, out
        self.bound = [(p, {k: v for k, v in vars(p).items() if _holds_tensors(v)}) for p in _programs(step)]

    def _run(self):
        now = [(p, {k: vars(p).get(k) for k in bound}) for p, bound in self.bound]
        for p, bound in self.bound:
            vars(p).update(bound)
        try:
            return self.step()
        finally:
            for p, current in now:
                vars(p).update(current)

    def replay(self) -> None:
        new = self._run()
        outs, new = (self.out, new) if isinstance(self.out, tuple) else ((self.out,), (new,))
        for o, n in zip(outs, new, strict=True):
            o.copy_(n)


def _capture(step, pool, stream=None):
    out = step()
    return _Graph(step, out), out


def _xqa(q, k_cache, v_cache, page_table, seq_lens, output, scratch, semaphores, num_kv_heads, page_size,
         sm_count=None, **kw) -> None:  # fmt: skip
    """flashinfer.xqa.xqa as the runtime calls it: q [B, 1, Hq, D]; K and V [P, page, Hkv, D] (views of
    the interleaved cache); a dense page table [B, pages] int32; lengths [B, 1] uint32."""
    assert sm_count == 1, "never split a request over blocks: the same reduction at any batch"
    assert page_table.dtype == torch.int32 and seq_lens.dtype == torch.uint32 and not kw
    group = q.shape[2] // num_kv_heads
    for b, n in enumerate(seq_lens.view(torch.int32)[:, 0].tolist()):
        pages = page_table[b, : -(-n // page_size)].long()
        keys = k_cache[pages].reshape(-1, num_kv_heads, q.shape[-1])[:n].repeat_interleave(group, 1)
        vals = v_cache[pages].reshape(-1, num_kv_heads, q.shape[-1])[:n].repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1))
        output[b] = o.transpose(0, 1)


@pytest.fixture(scope="module", params=["flashinfer", "xqa"])
def graph_runner_cls(request):
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper, fake.BatchDecodeWithPagedKVCacheWrapper = _Wrapper, _Decode
    fake.xqa = types.ModuleType("flashinfer.xqa")
    fake.xqa.xqa = _xqa
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", fake)
        mp.setitem(sys.modules, "flashinfer.xqa", fake.xqa)
        # Decode steps on XQA (resolved on the GPU by its compute capability): tables on the device
        # per slot, gathered per step, lengths from the positions inside the graph.
        mp.setattr("gpu_worker.attention.select.resolve_decode_attention", lambda *a: request.param)
        mp.setattr("gpu_worker.runner.graphs.capture", _capture)
        mp.setattr("gpu_worker.runner.prefill_graphs.capture", _capture)
        mp.setattr("gpu_worker.runner.depth_graphs.capture", _capture)
        mp.setattr("gpu_worker.runner.sample_graphs.capture", _capture)
        mp.setattr("torch.cuda.graph_pool_handle", lambda: None)
        mp.setattr("gpu_worker.attention.flashinfer.WORKSPACE_BYTES", 16)
        from gpu_worker.runner.graphs import GraphRunner

        class Runner(GraphRunner):
            decode = request.param  # which decode attention this one runs

        yield Runner


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    return p


def test_graph_runner_matches_eager_for_prefill_decode_and_mixed_steps(program, graph_runner_cls):
    n_seq, per = 15, pages_for(MAX_CONTEXT + 1, PAGE)
    shape = (program.num_layers, 1 + n_seq * per, PAGE, program.num_kv_heads, program.head_dim)
    kv_g = allocate_kv_cache(*shape, torch.float32, "cpu")
    kv_e = allocate_kv_cache(*shape, torch.float32, "cpu")
    graphs = graph_runner_cls(program, kv_g, GpuWorkerSettings(max_batch_size=16, max_context=MAX_CONTEXT))
    assert graphs.attn.name == graph_runner_cls.decode
    assert [r for r, _ in graphs.prefill.buckets] == [32, 48, 64, 96, 128, 256, 512]
    assert len(graphs.prefills) == graphs.max_prefills_per_step == 4
    eager = EagerRunner(program, TorchPagedAttention(kv_e, program.num_qo_heads))
    # The same graphs without mixed ones: a step's first prompt in lane 0's prefill graph.
    kv_l = allocate_kv_cache(*shape, torch.float32, "cpu")
    lanes = graph_runner_cls(program, kv_l, GpuWorkerSettings(max_batch_size=16, max_context=MAX_CONTEXT))
    lanes.mixed = {}
    rng = np.random.default_rng(0)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per))[::-1] for i in range(n_seq)]
    # Sequence i: prompt length, step it joins at. Step 0 prefills 28 and 40 rows (two lanes:
    # buckets 32 and 48); step 2 mixes 2 prefills with 2 decodes; step 4 brings 300 and 250 rows
    # (buckets 512 and 256); step 6 brings 4, one in every lane; step 7 brings 5 requests, more
    # than the lanes: all eagerly.
    lens = [28, 40, 7, 33, 300, 250, 20, 12, 9, 15, 30, 11, 13, 17, 19]
    joins = [0, 0, 2, 2, 4, 4, 6, 6, 6, 6, 7, 7, 7, 7, 7]
    seqs = [rng.integers(0, 1000, size=n + 10) for n in lens]
    last_rows = torch.zeros(n_seq, 1, dtype=torch.int64)  # the device table of fed-back rows
    # The first new request of a step with decode rows rides in a mixed graph (prompts <= 128 rows).
    assert {rows for _, rows, _ in graphs.mixed} == {32, 48, 64, 96, 128}
    mixed = []
    for key, (graph, _) in graphs.mixed.items():
        graph.replay = lambda key=key, replay=graph.replay: mixed.append(key) or replay()
    for t in range(10):
        pre = [i for i in range(n_seq) if joins[i] == t]
        dec = [i for i in range(n_seq) if joins[i] < t]
        ids, pos, rows, kv_lens = [], [], [], []
        for i in pre:
            ids += seqs[i][: lens[i]].tolist()
            pos += list(range(lens[i]))
            rows.append(lens[i])
            kv_lens.append(lens[i])
        for i in dec:
            k = lens[i] + t - joins[i] - 1
            ids.append(0)  # fed back on the device from last_rows
            last_rows[i, 0] = int(seqs[i][k])
            pos.append(k)
            rows.append(1)
            kv_lens.append(k + 1)
        order = pre + dec
        meta = np.array([order, [t - joins[i] for i in order], [lens[i] for i in order]], dtype=np.int64)
        b = StepBatch(
            np.array(ids, dtype=np.int64)[:, None],
            np.array(pos, dtype=np.int64),
            [0, *np.cumsum(rows).tolist()],
            kv_lens,
            [tables[i] for i in order],
            len(pre),
            meta=meta,
            last_rows=last_rows,
        )
        got, got_meta, _ = graphs.forward(b)
        want, want_meta, _ = eager.forward(b)
        # Bitwise: a mixed graph keeps its prompt's and decode rows' GEMMs apart (fp8.rows_apart).
        assert torch.equal(got, lanes.forward(b)[0]), f"step {t}"
        assert torch.equal(kv_g[:, 1:], kv_l[:, 1:]), f"step {t}"  # page 0: padding rows' scratch
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"step {t}")
        assert got_meta.tolist() == want_meta.tolist() == meta.tolist()
        torch.testing.assert_close(kv_g[:, 1:], kv_e[:, 1:], rtol=1e-4, atol=1e-4, msg=f"step {t}")
    # Step 2 (7 rows + 33 rows, 2 decoding): the first in a mixed graph (decode bucket 2, 32 rows),
    # the second in lane 1; step 6 (4 prompts, 6 decoding); step 4's 300 rows fit no mixed graph.
    assert mixed == [(2, 32, 1), (8, 32, 1)]  # (decode bucket, prompt bucket, prompts)


def test_a_graph_wrappers_tile_table_is_zeroed_and_one_without_it_is_named(caplog):
    """`zero_tile_table`: FlashInfer's page-locked tile table set to zeros in place (the buffer its
    plans copy to the device); a wrapper without one (another FlashInfer) is named in a warning."""
    from types import SimpleNamespace

    from gpu_worker.attention.flashinfer import zero_tile_table

    table = torch.full((32,), 9, dtype=torch.uint8)
    zero_tile_table(SimpleNamespace(_pin_memory_int_workspace_buffer=table))
    assert not table.any()
    with caplog.at_level("WARNING"):
        zero_tile_table(SimpleNamespace())
    assert "_pin_memory_int_workspace_buffer" in caplog.text and "SimpleNamespace" in caplog.text
