"""The sampler: reference semantics of each filter, and per-request determinism across batches."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from gpu_worker.runner.sampler import SamplingRows, apply_repetition_penalty, sample_rows

V = 50


def rows(b: int, **kw) -> SamplingRows:
    base = dict(
        temperature=torch.full((b,), 1.0),
        top_k=torch.zeros(b, dtype=torch.int64),
        top_p=torch.ones(b),
        min_p=torch.zeros(b),
        rep_penalty=torch.ones(b),
        seed=torch.arange(b, dtype=torch.int64) * 7919 + 1,
        counter=torch.zeros(b, dtype=torch.int64),
        history=torch.zeros(b, 1, dtype=torch.int64),
        block_stop=torch.zeros(b, dtype=torch.bool),
    )
    base.update(kw)
    return SamplingRows(**base)


NO_STOP = torch.empty(0, dtype=torch.int64)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, V)
    out = sample_rows(logits.clone(), rows(4, temperature=torch.zeros(4)), NO_STOP)
    assert torch.equal(out, logits.argmax(-1))


def test_a_row_samples_the_same_token_alone_or_in_any_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, V) * 3
    params = dict(
        temperature=torch.tensor([0.6, 1.0, 0.0, 1.3, 0.6, 0.9, 1.0, 0.7]),
        top_k=torch.tensor([0, 5, 0, 0, 10, 0, 3, 0]),
        top_p=torch.tensor([0.8, 1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 0.95]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0, 0.0]),
        rep_penalty=torch.tensor([1.3, 1.0, 1.1, 1.0, 1.3, 1.3, 1.0, 1.2]),
        seed=torch.arange(8, dtype=torch.int64) * 1_000_003,
        counter=torch.arange(8, dtype=torch.int64) * 3,
        history=torch.randint(0, V, (8, 6)),
        block_stop=torch.zeros(8, dtype=torch.bool),
    )
    together = sample_rows(logits.clone(), rows(8, **params), NO_STOP)
    for i in range(8):
        alone = sample_rows(
            logits[i : i + 1].clone(), rows(1, **{k: v[i : i + 1] for k, v in params.items()}), NO_STOP
        )
        assert alone.item() == together[i].item()
    perm = torch.randperm(8)
    shuffled = sample_rows(logits[perm].clone(), rows(8, **{k: v[perm] for k, v in params.items()}), NO_STOP)
    assert torch.equal(shuffled, together[perm])


def test_samples_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20_000
    seeds = torch.arange(n, dtype=torch.int64)
    out = sample_rows(
        logits.expand(n, 4).clone(),
        rows(
            n,
            seed=seeds,
            counter=torch.zeros(n, dtype=torch.int64),
            history=torch.zeros(n, 1, dtype=torch.int64),
        ),
        NO_STOP,
    )
    freq = torch.bincount(out, minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.015), freq


def test_top_k_top_p_and_min_p_exclude_the_tail():
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0, -1.0, -2.0]])
    n = 2000
    seeds = torch.arange(n, dtype=torch.int64)
    common = dict(
        seed=seeds, counter=torch.zeros(n, dtype=torch.int64), history=torch.zeros(n, 1, dtype=torch.int64)
    )
    k2 = sample_rows(logits.expand(n, 6).clone(), rows(n, top_k=torch.full((n,), 2), **common), NO_STOP)
    assert set(k2.tolist()) == {0, 1}
    # probs ≈ [.49, .45, .07, ...]: the first two hold > 0.8 of the mass, so 0.8 keeps exactly them.
    p = sample_rows(logits.expand(n, 6).clone(), rows(n, top_p=torch.full((n,), 0.8), **common), NO_STOP)
    assert set(p.tolist()) == {0, 1}
    m = sample_rows(logits.expand(n, 6).clone(), rows(n, min_p=torch.full((n,), 0.2), **common), NO_STOP)
    assert set(m.tolist()) == {0, 1}


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    logits = torch.randn(3, V)
    history = torch.randint(0, V, (3, 12))
    ours = logits.clone()
    apply_repetition_penalty(ours, history, torch.full((3,), 1.3))
    ref = RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    assert torch.allclose(ours, ref)


def test_min_tokens_blocks_stop_tokens():
    logits = torch.full((2, V), -5.0)
    logits[:, 7] = 10.0  # the stop token dominates
    out = sample_rows(
        logits.clone(),
        rows(2, temperature=torch.zeros(2), block_stop=torch.tensor([True, False])),
        torch.tensor([7]),
    )
    assert out[0].item() != 7 and out[1].item() == 7


def test_candidates_restrict_the_choice():
    logits = torch.randn(3, V)
    cand = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    for temp in (0.0, 1.0):
        out = sample_rows(
            logits.clone(), rows(3, temperature=torch.full((3,), temp), candidates=cand), NO_STOP
        )
        for i in range(3):
            assert out[i].item() in cand[i].tolist()
    greedy = sample_rows(logits.clone(), rows(3, temperature=torch.zeros(3), candidates=cand), NO_STOP)
    assert torch.equal(greedy, cand.gather(1, logits.gather(1, cand).argmax(-1, keepdim=True))[:, 0])


def test_a_rows_draw_does_not_depend_on_how_the_device_scans_its_batch(monkeypatch):
    """A GPU scans a lone row, a few rows and many rows each in its own order (float cumsums that
    round apart). Played here by a scan that adds blocks of 64 and then their offsets from 24 rows
    on: a row's draw at the edges of its own buckets is the same alone and among 31 others."""
    plain = torch.Tensor.cumsum

    def scan(x: torch.Tensor, dim: int = -1, **kw) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < 24 or x.shape[1] % 64:
            return plain(x, dim, **kw)
        blocks = plain(x.view(x.shape[0], -1, 64), -1)
        offsets = plain(blocks[:, :, -1], -1) - blocks[:, :, -1]
        return (blocks + offsets[:, :, None]).view(x.shape)

    monkeypatch.setattr(torch.Tensor, "cumsum", scan)
    v, b = 4096, 32
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(b, v, generator=gen) * 0.5  # a flat row: thousands of buckets of its mass
    mass = (logits[0] / 0.9).softmax(-1).sort(descending=True).values.double().cumsum(-1)
    u = (mass[50:4000:13] / mass[-1]).float()  # draws at (within rounding of) the row's bucket edges
    n = len(u)
    many = dict(temperature=torch.full((b,), 0.9), rep_penalty=torch.ones(b), history=None)
    one = dict(temperature=torch.full((1,), 0.9), rep_penalty=torch.ones(1), history=None)
    alone = [sample_rows(logits[:1].clone(), rows(1, **one), NO_STOP, u[i : i + 1]).item() for i in range(n)]
    together = [
        sample_rows(logits.clone(), rows(b, **many), NO_STOP, u[i].repeat(b))[0].item() for i in range(n)
    ]
    assert len(set(alone)) > n // 2 and alone == together
