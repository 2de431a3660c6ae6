"""The sampler's tail as one Triton kernel (gpu_worker/runner/sample_kernel.py, what a GPU runs) draws
the ids of the torch path (`sampler._sample_tail`, what a CPU runs) for the same rows and uniform
numbers: greedy rows, temperature, top-k on and off, top-p, min-p, ties, masked (-inf) columns, a
vocabulary that is not a power of two, and rows of a batch computed as they are alone. Run in
Triton's interpreter on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets there)."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.runner.sampler import SamplingRows, _sample_tail
from tests.conftest import interpreted_kernel


@pytest.fixture(scope="module")
def sample_tail():
    return interpreted_kernel("gpu_worker.runner.sample_kernel", "sample_tail")


def rows_of(b: int, gen: torch.Generator) -> SamplingRows:
    temperature = torch.rand(b, generator=gen) * 1.5
    temperature[::5] = 0.0  # greedy rows
    top_k = torch.randint(0, 80, (b,), generator=gen)
    top_k[::3] = 0  # off
    top_p = torch.where(torch.rand(b, generator=gen) < 0.5, torch.ones(b), torch.rand(b, generator=gen))
    min_p = torch.where(
        torch.rand(b, generator=gen) < 0.5, torch.zeros(b), torch.rand(b, generator=gen) * 0.2
    )
    return SamplingRows(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        rep_penalty=torch.ones(b),
        seed=torch.arange(b),
        counter=torch.zeros(b, dtype=torch.int64),
        history=None,
        block_stop=torch.zeros(b, dtype=torch.bool),
    )


@pytest.mark.parametrize("vocab", [256, 200])  # the interpreter takes ~0.5 s a row of 256
def test_the_kernel_draws_the_torch_ids(sample_tail, vocab):
    gen = torch.Generator().manual_seed(vocab)
    b = 20
    logits = torch.randn(b, vocab, generator=gen) * 3
    logits[1::7, : vocab // 2] = float("-inf")  # masked columns
    logits[2::7] = torch.randint(0, 4, (vocab,), generator=gen).float()  # many ties
    rows = rows_of(b, gen)
    u = torch.rand(b, generator=gen)
    want = _sample_tail(logits.clone(), rows, u)
    got = sample_tail(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, u)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert len(set(got.tolist())) > b // 2  # the rows draw different ids


def test_a_rows_id_does_not_depend_on_its_batch_and_u_may_be_a_strided_column(sample_tail):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=gen)
    rows = rows_of(6, gen)
    drawn = torch.rand(6, 4, generator=gen)  # [B, salts], as depth_sampler draws them
    batch = sample_tail(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, drawn[:, 2])
    for i in range(6):
        one = sample_tail(
            logits[i : i + 1], rows.temperature[i : i + 1], rows.top_k[i : i + 1],
            rows.top_p[i : i + 1], rows.min_p[i : i + 1], drawn[i : i + 1, 2],
        )  # fmt: skip
        assert one.item() == batch[i].item()
    assert torch.equal(batch, _sample_tail(logits.clone(), rows, drawn[:, 2].contiguous()))
