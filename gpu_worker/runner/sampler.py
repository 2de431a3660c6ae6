"""Batched sampling with per-request determinism.

Order per row (as the reference servers apply it): repetition penalty over the request's last
`repetition_window` tokens of prompt + output (HF/vLLM rule: positive logits divided, negative
multiplied), stop tokens masked until `min_tokens`, optional constraint to the program's
candidate ids, then greedy (temperature 0) or temperature → top-k → top-p → min-p and an
inverse-CDF draw. The draw's uniform number is `rng.uniform(seed, n_generated)`: a pure function of
the request, so a request samples the same tokens whatever batch it lands in, and every operation
here is row-wise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from programs.blocks import rng


@dataclass
class SamplingRows:
    """Per-row sampling inputs for one step, all on the sampler's device. B rows."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    rep_penalty: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    counter: torch.Tensor  # [B] int64: tokens generated so far (the draw's counter)
    history: (
        torch.Tensor | None
    )  # [B, W] int64: recent tokens, padded by repeating a real one; None: no penalty
    block_stop: torch.Tensor  # [B] bool: min_tokens not reached yet
    candidates: torch.Tensor | None = None  # [B, K] int64 ids the rows may take


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: torch.Tensor) -> None:
    """In place. logits [B, V]; history [B, W] (duplicates harmless: same value written twice)."""
    seen = logits.gather(1, history)  # [B, W]
    p = penalty[:, None]
    logits.scatter_(1, history, torch.where(seen > 0, seen / p, seen * p))


# Probabilities in units of 2^-32 (`fixed_mass`): the sampler's running sums are integer sums.
MASS_ONE = 1 << 32


def fixed_mass(probs: torch.Tensor) -> torch.Tensor:
    """probs [B, V] float32 in [0, 1] → int64, each in units of 2^-32 (rounded; below 2^-33: 0).
    The sampler's running sums (top-p's mass before a token, the draw's CDF) add these integers,
    which is exact in any order: a row's sums have the same value whatever scan the device picks for
    its batch. A float cumsum does not: CUDA scans a lone row otherwise than rows of a batch, and
    rows of a batch from some row count on otherwise again (on the H200, a row of the audio head's
    4,113 from 24 rows: bench/op_invariance.py), which moved a sampled draw across a bucket edge
    (tests/gpu/test_gpu_burst_prefill_invariance.py, 28 requests)."""
    return torch.round(probs * MASS_ONE).to(torch.int64)


def sample_rows(
    logits: torch.Tensor, rows: SamplingRows, stop_ids: torch.Tensor, u: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [B, V] float32 (modified in place) → token ids [B] int64. `u` [B]: the draws'
    uniform numbers when the caller has them already (`rng.uniform(rows.seed, rows.counter)`)."""
    if rows.history is not None:
        apply_repetition_penalty(logits, rows.history, rows.rep_penalty)
    if stop_ids.numel():
        blocked = logits[:, stop_ids].masked_fill(rows.block_stop[:, None], float("-inf"))
        logits[:, stop_ids] = blocked
    ids = rows.candidates
    if ids is not None:
        logits = logits.gather(1, ids)  # [B, K]
    if u is None:
        u = rng.uniform(rows.seed, rows.counter)
    if _tail[0] is not None and logits.is_cuda:  # the rest in one kernel (sample_kernel.py)
        choice = _tail[0](logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, u)
    else:
        choice = _sample_tail(logits, rows, u)
    if ids is not None:
        choice = ids.gather(1, choice[:, None])[:, 0]
    return choice


_tail: list = [None]  # sample_kernel.sample_tail while `use_tail_kernel` has it on


def use_tail_kernel(on: bool) -> bool:
    """Sample on a GPU with the tail as one Triton kernel (sample_kernel.py; --fused-step on) or in
    torch (off, the default); → whether the kernel is on (False where Triton does not import)."""
    _tail[0] = None
    if on:
        try:
            from gpu_worker.runner.sample_kernel import sample_tail
        except ImportError:
            return False
        _tail[0] = sample_tail
    return _tail[0] is not None


def _sample_tail(logits: torch.Tensor, rows: SamplingRows, u: torch.Tensor) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p → the inverse-CDF draw at u [B] (greedy rows: argmax)."""
    greedy = logits.argmax(dim=-1)  # [B]
    temp = rows.temperature.clamp_min(1e-5)[:, None]
    # Stable: among equal values the lower column ranks first, on every device (and in sample_kernel).
    sorted_logits, order = torch.sort(logits / temp, dim=-1, descending=True, stable=True)  # [B, V']
    rank = torch.arange(sorted_logits.shape[-1], device=logits.device)[None, :]
    top_k = torch.where(rows.top_k > 0, rows.top_k, sorted_logits.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass = fixed_mass(probs)  # [B, V'] int64
    # top-p: drop a token when the tokens ranked above it already hold top_p of the mass (so the
    # first token always stays); top_p 1 drops none (the rounded masses may sum past 2^32).
    keep = (rows.top_p * MASS_ONE).long().masked_fill(rows.top_p >= 1, torch.iinfo(torch.int64).max)
    drop = mass.cumsum(dim=-1) - mass > keep[:, None]
    drop |= probs < rows.min_p[:, None] * probs[:, :1]
    cdf = mass.masked_fill(drop, 0).cumsum(dim=-1)  # [B, V'] int64
    # the first rank whose running mass reaches u times the total (cdf >= x ⇔ cdf >= ceil(x))
    at = (u.double() * cdf[:, -1].double()).ceil().long()[:, None]
    pick = torch.searchsorted(cdf, at).clamp_max(cdf.shape[-1] - 1)  # [B, 1]
    sampled = order.gather(1, pick)[:, 0]
    return torch.where(rows.temperature > 0, sampled, greedy)


def depth_sampler(rows: SamplingRows, salts: int = 0):
    """The `sample(logits, salt)` handed to a program's `decode_tokens`: the request's temperature,
    top-k/p and min-p, no penalty or stop masking, and a random stream keyed by (seed, salt) at the
    same counter, so each salt draws independently of codebook 0 and of the batch. The uniform
    numbers of salts 0..salts-1 are computed up front in one [B, salts] pass (the same integer
    arithmetic, so the same numbers): per salt, the key mixing is a few dozen tiny kernels, which
    dominate a depth step's launches."""
    no_stop = torch.empty(0, dtype=torch.int64, device=rows.seed.device)
    plain = dataclasses.replace(rows, history=None, candidates=None)
    drawn = None
    if salts:
        salt = torch.arange(salts, dtype=torch.int64, device=rows.seed.device)[None, :]
        drawn = rng.uniform(rng.mix_keys(rows.seed[:, None], salt), rows.counter[:, None])  # [B, salts]

    def sample(logits: torch.Tensor, salt: int) -> torch.Tensor:
        if drawn is not None and 0 <= salt < salts:
            return sample_rows(logits.float(), plain, no_stop, drawn[:, salt])
        salted = dataclasses.replace(plain, seed=rng.mix_keys(rows.seed, salt))
        return sample_rows(logits.float(), salted, no_stop)

    def untempered(logits: torch.Tensor, salt: int) -> torch.Tensor:
        """logits [B, K, V] → ids [B, K]: draws from each row's softmax as it is (temperature 1, no
        top-k/p or min-p, greedy requests too), entry k keyed by (seed, salt + k), all in one pass."""
        b, k, v = logits.shape
        key = rng.mix_keys(rows.seed[:, None], salt + torch.arange(k, device=rows.seed.device)[None, :])
        flat = SamplingRows(
            temperature=torch.ones(b * k, device=logits.device),
            top_k=torch.zeros(b * k, dtype=torch.int64, device=logits.device),
            top_p=torch.ones(b * k, device=logits.device),
            min_p=torch.zeros(b * k, device=logits.device),
            rep_penalty=torch.ones(b * k, device=logits.device),
            seed=key.reshape(-1),
            counter=rows.counter[:, None].expand(b, k).reshape(-1),
            history=None,
            block_stop=torch.zeros(b * k, dtype=torch.bool, device=logits.device),
        )
        return sample_rows(logits.reshape(b * k, v).float(), flat, no_stop).view(b, k)

    sample.untempered = untempered  # type: ignore[attr-defined]
    return sample


class HeadColumns:
    """Sampling over a partial output head (`program.head_ids`): token ids in the sampling inputs
    become logits columns, with one extra *sink* column, always -inf, for ids outside the head (a
    text token in the penalty history, say), and sampled columns become token ids again."""

    def __init__(self, head_ids: torch.Tensor, vocab_size: int) -> None:
        v = head_ids.numel()
        self.column = torch.full((vocab_size,), v, dtype=torch.int64, device=head_ids.device)  # [V]
        self.column[head_ids] = torch.arange(v, device=head_ids.device)
        self.ids = torch.cat([head_ids, head_ids[-1:]])  # [V' + 1]; the sink is never sampled

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V'] → [B, V' + 1] with the sink column."""
        return torch.cat([logits, logits.new_full((logits.shape[0], 1), float("-inf"))], dim=1)

    def rows(self, rows: SamplingRows) -> SamplingRows:
        if rows.history is not None:
            rows.history = self.column[rows.history]
        if rows.candidates is not None:
            rows.candidates = self.column[rows.candidates]
        return rows
