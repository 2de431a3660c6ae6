"""The depth sampler computes every salt's uniform numbers in one pass; each salt still draws the
tokens a sampler keyed by that salt alone draws (the same integer arithmetic), for seeds and
counters over the whole int64 range."""

from __future__ import annotations

import dataclasses

import torch

from gpu_worker.runner.sampler import SamplingRows, depth_sampler, sample_rows
from programs.blocks import rng


def test_each_salt_draws_what_its_own_stream_draws() -> None:
    b = 6
    rows = SamplingRows(
        temperature=torch.tensor([0.9, 0.9, 1.3, 0.0, 0.7, 0.9]),
        top_k=torch.tensor([50, 0, 50, 50, 7, 2048]),
        top_p=torch.tensor([0.95, 1.0, 0.8, 1.0, 1.0, 0.5]),
        min_p=torch.zeros(b),
        rep_penalty=torch.ones(b),
        seed=torch.tensor([0, 1, -5, 2**62, 12345, -(2**63)]),
        counter=torch.tensor([0, 3, 7, 100, 2**40, 9]),
        history=None,
        block_stop=torch.zeros(b, dtype=torch.bool),
    )
    batched = depth_sampler(rows, 16)
    gen = torch.Generator().manual_seed(0)
    picked = []
    for salt in range(20):  # 16.. fall back to per-call keys
        logits = torch.randn(b, 2048, generator=gen) * 3
        own = dataclasses.replace(rows, seed=rng.mix_keys(rows.seed, salt))
        want = sample_rows(logits.clone(), own, torch.empty(0, dtype=torch.int64))
        got = batched(logits.clone(), salt)
        assert torch.equal(got, want), salt
        picked.append(got)
    assert len({tuple(p.tolist()) for p in picked}) > 15  # the salts draw apart
