"""The code predictor's one-shape position step (programs/qwen3_tts/fused.py: every position with
the same shapes, a masked cache of all slots, the position a device tensor; what --depth-compile
compiles) gives the eager step's codes: greedy and sampled frames equal, hidden states within
float32 rounding, at several batch sizes (qwen3-tts-tiny, CPU float32, uncompiled)."""

from __future__ import annotations

import torch

from gpu_worker.runner.sampler import SamplingRows, depth_sampler
from programs import get_spec, load_program_class
from programs.qwen3_tts.fused import position_step


def rows(n: int, temperature: float) -> SamplingRows:
    return SamplingRows(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), 50, dtype=torch.int64),
        top_p=torch.ones(n),
        min_p=torch.zeros(n),
        rep_penalty=torch.ones(n),
        seed=torch.arange(n, dtype=torch.int64) + 11,
        counter=torch.full((n,), 3, dtype=torch.int64),
        history=None,
        block_stop=torch.zeros(n, dtype=torch.bool),
    )


def test_one_shape_steps_give_the_eager_frames() -> None:
    program = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    program.load_lm()
    lm = program.lm
    gen = torch.Generator().manual_seed(0)
    for b in (1, 3, 8):
        hidden = torch.randn(b, program.hidden_size, generator=gen)
        c0 = torch.randint(0, 2048, (b,), generator=gen)
        for temperature in (0.0, 0.9):
            lm.compile_predictor(False)
            eager = lm.predict(hidden, c0, depth_sampler(rows(b, temperature), 16))
            lm.compile_predictor(True, compiler=lambda fn: fn)  # the function torch.compile takes
            one_shape = lm.predict(hidden, c0, depth_sampler(rows(b, temperature), 16))
            assert torch.equal(eager, one_shape), (b, temperature)
    lm.compile_predictor(False)
    assert len({tuple(r) for r in one_shape.tolist()}) > 1  # frames of different rows differ


def test_a_position_step_matches_the_eager_position() -> None:
    program = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    program.load_lm()
    lm = program.lm
    lm.fuse_predictor()
    m = lm.code_predictor.model
    b, c, hkv = 4, lm.n_codebooks, m.layers[0].self_attn.num_kv_heads
    shape = (len(m.layers), b, hkv, c, m.head_dim)
    keys, values = torch.empty(shape), torch.empty(shape)
    k1, v1 = torch.zeros(shape), torch.zeros(shape)
    gen = torch.Generator().manual_seed(1)
    for t in range(c):
        x = torch.randn(b, m.layers[0].self_attn.q_proj.weight.shape[1], generator=gen)
        want = lm._predictor_position(x, t, keys, values)
        got, k1, v1 = position_step(lm, x, lm.predictor_positions[t], k1, v1)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), t
        assert torch.allclose(k1[:, :, :, : t + 1], keys[:, :, :, : t + 1], atol=1e-6)


def test_every_predictor_gemm_goes_through_fp8_linear(monkeypatch) -> None:
    """So `--decode-row-tile` and `--invariant-gemm` reach the predictor's joint q/k/v and gate/up
    GEMMs as they do its o/down projections and heads: under row tiles every GEMM of the eager and
    the one-shape step holds the tile's rows, and every joint weight is among them."""
    from programs.blocks import fp8

    program = load_program_class("qwen3-tts-tiny")(get_spec("qwen3-tts-tiny"), load_format="dummy")
    program.load_lm()
    lm = program.lm
    lm.fuse_predictor()
    real, rows_seen, weights_seen = fp8._linear, [], []

    def spy(x, weight, bias):
        rows_seen.append(x.shape[0])
        weights_seen.append(weight)
        return real(x, weight, bias)

    monkeypatch.setattr(fp8, "_linear", spy)
    hidden, c0 = torch.randn(3, program.hidden_size), torch.randint(0, 2048, (3,))
    for one_shape in (False, True):
        lm.compile_predictor(one_shape, compiler=lambda fn: fn)
        rows_seen.clear()
        weights_seen.clear()
        with fp8.row_tiles(4):
            lm.predict(hidden, c0, depth_sampler(rows(3, 0.0), 16))
        assert set(rows_seen) == {4}, one_shape
        joint = [*lm._qkv, *lm._gate_up]
        assert all(any(w is j for w in weights_seen) for j in joint), one_shape
    lm.compile_predictor(False)
