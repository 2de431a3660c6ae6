"""The codec worker's `Codec` decodes a pass holding regular windows and lead windows (1-3 frames)
together: each row count is decoded as its own batch, and the AudioChunks come back in the order the
chunks came, each with its own length (2048 samples per regular window, L * 2048 per lead window of
L frames) and the audio that chunk has when decoded alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.worker import Codec
from common.messages import LEAD_NOISE_BASE, DetokChunk
from programs import get_spec, load_program_class
from programs.base import pcm16
from programs.blocks import rng


@pytest.fixture(scope="module")
def codec() -> Codec:
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    program.load_codec()
    return Codec(program, max_batch=2, graphs=False)


def _chunk(gen: torch.Generator, rid: str, index: int, rows: int, valid: bool = True) -> DetokChunk:
    codes = torch.randint(0, 4096, (rows,), generator=gen)
    tokens = 128266 + 4096 * (torch.arange(rows) % 7) + codes
    if not valid:
        tokens[0] = 1000  # a text token: the window is dropped
    noise_id = LEAD_NOISE_BASE + rows if rows < 28 else index
    return DetokChunk(
        rid, index, seed=7 + index, tokens=tokens.int().numpy().astype("<i4").tobytes(), noise_id=noise_id
    )


def test_mixed_row_counts_come_back_in_order_with_their_lengths(codec) -> None:
    gen = torch.Generator().manual_seed(0)
    plan = [("a", 0, 28), ("b", 0, 7), ("a", 1, 28), ("c", 0, 14), ("d", 0, 21), ("e", 0, 7)]
    plan += [("a", i, 28) for i in range(2, 4)]  # more regular windows than max_batch
    chunks = [_chunk(gen, rid, index, rows) for rid, index, rows in plan]
    out = codec.decode(chunks)
    assert [(a.rid, a.index) for a in out] == [(rid, index) for rid, index, _ in plan]
    assert [len(a.pcm) // 2 for a in out] == [rows // 7 * 2048 if rows < 28 else 2048 for *_, rows in plan]
    for c, a in zip(chunks, out, strict=True):
        [alone] = codec.decode([c])
        np.testing.assert_allclose(
            np.frombuffer(a.pcm, "<i2").astype(int), np.frombuffer(alone.pcm, "<i2").astype(int), atol=1
        )


def test_lead_chunk_pcm_is_the_programs_lead_window_audio(codec) -> None:
    gen = torch.Generator().manual_seed(1)
    chunks = [_chunk(gen, "x", 0, 14), _chunk(gen, "y", 3, 28), _chunk(gen, "z", 0, 14, valid=False)]
    out = codec.decode(chunks)
    c = chunks[0]
    tokens = torch.from_numpy(np.frombuffer(c.tokens, "<i4").astype(np.int64)).view(1, 14, 1)
    keys = rng.mix_keys(torch.tensor([c.seed]), torch.tensor([c.noise_id]))
    audio, valid = codec.program.detokenize(tokens, keys)
    assert bool(valid[0]) and audio.shape == (1, 4096)
    want = pcm16(audio)[0].numpy().astype(int)
    np.testing.assert_allclose(np.frombuffer(out[0].pcm, "<i2").astype(int), want, atol=1)
    assert np.abs(want).max() > 100  # not silence
    assert out[2].pcm == b""  # an invalid lead window yields no audio, like a regular one


def test_a_chunk_of_an_unknown_row_count_is_an_error(codec) -> None:
    bad = DetokChunk("r", 0, seed=1, tokens=np.zeros(8, "<i4").tobytes())
    launched = codec.launch([bad])
    assert codec.collect(launched) == [] and "8 rows" in launched.failed["r"].message
