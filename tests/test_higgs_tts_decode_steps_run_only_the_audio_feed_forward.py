"""Higgs Audio v2's DualFFN runs the text feed-forward path on the prompt rows only where the step
says where its prompt rows end (`Rows.prompt_rows`): a decode step (every row a generated, audio
row) gives the logits of the path that runs both feed-forwards on every row and keeps each row's
own, bit for bit (CPU fp32: the same audio norms and MLP on the same rows), without calling the
text norms or MLP; a step with prompt rows and decode rows gives them within float rounding, the
text path on the prompt rows only (the audio path on every row: a prompt row may be a cloned
voice's audio row). Through the eager runner and the graph runner (CPU stand-ins for FlashInfer
and CUDA graphs), the text MLP sees exactly the prompt rows; a decode graph runs no text MLP.
Every weight is random, the norms too, so that either path taken for the other's rows changes the
logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.attention.interface import StepLayout
from gpu_worker.attention.torch_paged import TorchPagedAttention
from gpu_worker.engine import Engine
from gpu_worker.runner.batch import StepBatch
from gpu_worker.runner.eager import EagerRunner
from gpu_worker.runner.kv_cache import allocate_kv_cache
from programs.base import Rows
from programs.higgs_tts import spec as h
from tests.conftest import tiny_lm_on_one_thread
from tests.engine_runs import graph_engine, staggered
from tests.test_graph_runner_replays_match_eager_on_cpu import graph_runner_cls  # noqa: F401 (fixture)

PAGE = 16
TEXTS = ("Hello there.", "A longer sentence, to speak slowly.", "Yes.")


@pytest.fixture(scope="module")
def program():
    for p in tiny_lm_on_one_thread("higgs-tts-tiny"):
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():  # every weight random, norms around 1
            for name, t in p.lm.named_parameters():
                norm = name.endswith("norm.weight")
                t.copy_(torch.randn(t.shape, generator=gen) * (0.2 if norm else 0.05) + float(norm))
        yield p


class PathRows:
    """Rows each of layer 0's paths sees, per forward pass: [q rows, text-MLP rows, audio-MLP rows]
    and the text input norm's calls (forward hooks)."""

    def __init__(self, program) -> None:
        layer = program.lm.model.layers[0]
        self.passes: list[list[int]] = []
        self.text_norm_calls = 0
        hooks = [
            (layer.self_attn.q_proj, lambda x: self.passes.append([len(x), 0, 0])),
            (layer.mlp, lambda x: self._add(1, len(x))),
            (layer.audio_mlp, lambda x: self._add(2, len(x))),
            (layer.input_layernorm, lambda x: self._norm()),
            (layer.post_attention_layernorm, lambda x: self._norm()),
        ]
        self.handles = [m.register_forward_hook(lambda m, args, out, f=f: f(args[0])) for m, f in hooks]

    def _add(self, i: int, n: int) -> None:
        self.passes[-1][i] += n

    def _norm(self) -> None:
        self.text_norm_calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def prompt_batch(program, texts: tuple[str, ...], first_slot: int = 0) -> StepBatch:
    """New requests of `texts` in slots first_slot.. as one prefill step, each on pages of its own."""
    prompts = [program.preprocess(t, {}).rows.astype(np.int64) for t in texts]
    lens = [len(p) for p in prompts]
    steps = np.concatenate([np.arange(-n, 0) for n in lens])
    slots = np.repeat(np.arange(first_slot, first_slot + len(texts)), lens)
    return StepBatch(
        ids=np.concatenate(prompts),
        pos=np.concatenate([np.arange(n) for n in lens]),
        qo_indptr=[0, *np.cumsum(lens).tolist()],
        kv_lens=lens,
        page_tables=[[1 + 8 * s + j for j in range(8)] for s in range(first_slot, first_slot + len(texts))],
        num_prefill=len(texts),
        where=np.stack([slots, steps], axis=1),
    )


def with_decode_rows(pre: StepBatch | None, ctx: list[int], seed: int) -> StepBatch:
    """`pre`'s new requests (if any), then one generated row (random codes, stream bos and eos
    among them) for each request of slots 0..len(ctx)-1, whose contexts are `ctx`."""
    rng = np.random.default_rng(seed)
    n = len(ctx)
    codes = rng.integers(0, h.FORCED_EOS + 1, size=(n, h.N_CODEBOOKS))
    dec = dict(
        ids=codes,
        pos=np.asarray(ctx),
        kv=[c + 1 for c in ctx],
        tables=[[1 + 8 * s + j for j in range(8)] for s in range(n)],
        where=np.stack([np.arange(n), np.full(n, 3)], axis=1),
    )
    if pre is None:
        pre = StepBatch(np.zeros((0, h.N_CODEBOOKS), np.int64), np.zeros(0, np.int64), [0], [], [], 0)
        pre.where = np.zeros((0, 2), np.int64)
    qo = pre.qo_indptr + (pre.qo_indptr[-1] + np.arange(1, n + 1)).tolist()
    return StepBatch(
        ids=np.concatenate([pre.ids, dec["ids"]]),
        pos=np.concatenate([pre.pos, dec["pos"]]),
        qo_indptr=qo,
        kv_lens=pre.kv_lens + dec["kv"],
        page_tables=pre.page_tables + dec["tables"],
        num_prefill=pre.num_prefill,
        where=np.concatenate([pre.where, dec["where"]]),
    )


def both_paths(program, attn: TorchPagedAttention, b: StepBatch) -> torch.Tensor:
    """The step's logits [B, 1, V] with no split given: both feed-forward paths on every row, each
    row keeping its own by the flag from its step."""
    where = torch.from_numpy(b.row_where())
    attn.plan(StepLayout(b.qo_indptr, b.kv_lens, b.page_tables, torch.from_numpy(b.pos)))
    with torch.inference_mode():
        emb = program.embed(torch.from_numpy(b.ids), Rows(where[:, 0], where[:, 1]))
        hidden = program.backbone(emb, torch.from_numpy(b.pos), attn)
        return program.head(hidden[torch.tensor(b.qo_indptr[1:]) - 1]).float()


def test_a_decode_step_gives_the_both_path_logits_bit_for_bit_without_the_text_path(program):
    cache = allocate_kv_cache(program.num_layers, 64, PAGE, program.num_kv_heads, program.head_dim,
                              torch.float32, torch.device("cpu"))  # fmt: skip
    attn = TorchPagedAttention(cache, program.num_qo_heads)
    runner = EagerRunner(program, attn)
    runner.forward(prompt_batch(program, TEXTS[:2]))  # the requests' prompts in the cache
    ctx = [len(program.preprocess(t, {}).rows) for t in TEXTS[:2]]
    rows = PathRows(program)
    try:
        decode = with_decode_rows(None, ctx, seed=1)
        split = runner.forward(decode)[0]
        assert rows.passes == [[2, 0, 2]] and rows.text_norm_calls == 0
        both = both_paths(program, attn, decode)
        assert rows.passes[1] == [2, 2, 2] and rows.text_norm_calls == 2
        assert torch.equal(split, both)

        mixed = with_decode_rows(prompt_batch(program, TEXTS[2:], first_slot=2), [c + 1 for c in ctx], 2)
        n_text = mixed.qo_indptr[1]
        split = runner.forward(mixed)[0]
        assert rows.passes[2] == [n_text + 2, n_text, n_text + 2]
        both = both_paths(program, attn, mixed)
        assert rows.passes[3] == [n_text + 2] * 3
    finally:
        rows.remove()
    torch.testing.assert_close(split, both, rtol=1e-5, atol=1e-5)


def prompts(program) -> list[Prompt]:
    out = []
    for i, text in enumerate(TEXTS):
        r = program.preprocess(text, {}).rows.astype("<i4")
        out.append(
            Prompt(f"r{i}", r.tobytes(), len(r), SamplingParams(max_tokens=len(r) + 12, temperature=0.0))
        )
    return out


def test_runners_give_the_text_mlp_only_the_prompt_rows(program, graph_runner_cls):  # noqa: F811
    limits = dict(max_batch_size=4, max_context=200)
    prompt_rows = sum(p.n_rows for p in prompts(program))
    for make in (lambda: Engine(program, GpuWorkerSettings(**limits)),
                 lambda: graph_engine(program, graph_runner_cls, limits)):  # fmt: skip
        eng = make()
        rows = PathRows(program)  # after the graphs' capture
        try:
            outputs = staggered(eng, prompts(program))
        finally:
            rows.remove()
        assert all(len(r) == 12 for r, _ in outputs.values())
        passes = np.array(rows.passes)  # [forward passes, 3]
        assert (passes[:, 0] == passes[:, 2]).all()  # the audio path on every row (prompt clips)
        if isinstance(eng.runner.forward_runner, EagerRunner):
            assert passes[:, 1].sum() == prompt_rows  # a prompt's rows once, the text path only
            assert ((passes[:, 1] > 0) & (passes[:, 1] < passes[:, 0])).any(), (
                "a step with prompt and decode rows"
            )
        else:  # prefill graphs (text rows, padding rows counted with them), decode graphs
            assert passes[:, 1].sum() >= prompt_rows
        assert (passes[:, 1] == 0).sum() >= 11, "decode steps run no text MLP"
