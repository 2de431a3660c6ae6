"""On a GPU, a window's PCM is the same bits decoded alone or batched with 1 to 40 other windows
(other graph buckets), wherever it sits, through the codec graphs and the eager path (calls of one
fixed size in both), for orpheus-tiny and csm-tiny in float32 and float16."""

from __future__ import annotations

import pytest
import torch

from codec_worker.codec import Codec
from common.messages import DetokChunk
from programs import get_spec, load_program_class


def windows(program, n: int, seed: int) -> list[DetokChunk]:
    """n regular windows of random codes (Orpheus: token ids of each frame's codebooks)."""
    gen = torch.Generator().manual_seed(seed)
    rows, c = program.detok_interval, program.n_codebooks
    codes = torch.randint(0, 2048, (n, rows, c), generator=gen)
    if program.name.startswith("orpheus"):
        codes = 128266 + 4096 * (torch.arange(rows) % 7)[None, :, None] + codes
    out = codes.int().numpy().astype("<i4")
    index = 0 if program.codec_streams else 3  # a stream's window needs its earlier ones: a first one
    return [DetokChunk(f"r{seed}-{i}", index, 7 + i, out[i].tobytes(), 3) for i in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize(
    "model, graphs",
    [
        ("orpheus-tiny", True),
        ("orpheus-tiny", False),
        ("csm-tiny", True),
        ("csm-tiny", False),
    ],
)
def test_a_window_decodes_to_the_same_bits_in_any_bucket(
    model: str, graphs: bool, dtype: str, gpu_report
) -> None:
    program = load_program_class(model)(
        get_spec(model), load_format="dummy", device="cuda", codec_dtype=dtype
    )
    program.load_codec()
    # codec slots for every request id the test sends (it never ends one)
    codec = Codec(program, max_batch=64, graphs=graphs, streams=256 if program.codec_streams else 0)
    [mine] = windows(program, 1, seed=0)
    [alone] = codec.decode([mine])
    differ = []
    for n in (1, 2, 5, 9, 17, 33, 40):
        others = windows(program, n, seed=n)
        for pos in (0, n // 2, n):
            out = codec.decode(others[:pos] + [mine] + others[pos:])
            if out[pos].pcm != alone.pcm:
                differ.append((n, pos))
    gpu_report(f"codec_batch_bits_{model}_{dtype}_{'graphs' if graphs else 'eager'}")["differ"] = differ
    assert not differ, f"batched (others, position) whose PCM differs from the window alone: {differ}"
