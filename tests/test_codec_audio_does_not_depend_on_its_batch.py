"""A window's PCM is the same bits whether the codec decodes it alone or batched with 1, 5 or 17
other windows, wherever it sits in the batch (the eager path's calls of one fixed size: CPU
convolutions round by batch size), so a seed fixes a request's audio however its windows are
gathered. With codec streams (csm-tiny) each window starts its own stream (chunk 0, a fresh
slot)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from common.messages import DetokChunk
from programs import get_spec, load_program_class


def windows(codec: Codec, n: int, seed: int) -> list[DetokChunk]:
    p = codec.program
    gen = torch.Generator().manual_seed(seed)
    rows, c = p.detok_interval, p.n_codebooks
    if p.name.startswith("orpheus"):
        codes = (
            128266
            + 4096 * (torch.arange(rows) % 7)[None, :, None]
            + torch.randint(0, 4096, (n, rows, c), generator=gen)
        )
    else:
        codes = torch.randint(0, 2048, (n, rows, c), generator=gen)
    out = codes.int().numpy().astype("<i4")
    index = 0 if p.codec_streams else 3  # a stream's window needs its earlier ones: a first one
    return [DetokChunk(f"r{seed}-{i}", index, 7 + i, out[i].tobytes(), 3) for i in range(n)]


@pytest.mark.parametrize("model", ["orpheus-tiny", "csm-tiny"])
def test_a_window_decodes_to_the_same_bits_in_any_batch(model: str) -> None:
    program = load_program_class(model)(get_spec(model), load_format="dummy")
    program.load_codec()
    codec = Codec(program, max_batch=64, graphs=False, streams=32 if program.codec_streams else 0)
    [mine] = windows(codec, 1, seed=0)
    [alone] = codec.decode([mine])
    assert len(alone.pcm) == 2 * program.detok_samples and np.frombuffer(alone.pcm, "<i2").any()
    rng = np.random.default_rng(0)
    for n in (1, 5, 17):
        others = windows(codec, n, seed=n)
        for pos in sorted({0, int(rng.integers(0, n + 1)), n}):
            batch = others[:pos] + [mine] + others[pos:]
            out = codec.decode(batch)
            assert out[pos].pcm == alone.pcm, f"batched with {n} others at {pos}"
