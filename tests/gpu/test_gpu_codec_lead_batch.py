"""On a GPU, `--codec-lead-batch`: a pass of 128 first chunks (Orpheus lead windows of 3 frames,
as a burst's young streams send them together) decodes to the same bits in graphs of up to 128
lead windows as in the default parts of 16, each call of 16 windows either way. The report holds
both passes' times in float16, as served: the price of the parts that a burst's first chunks
queue in."""

from __future__ import annotations

import numpy as np
import torch
from parity_checks import codec_pass_ms

from codec_worker.codec import LEAD_MAX_BATCH, Codec
from common.messages import LEAD_NOISE_BASE, DetokChunk
from programs import get_spec, load_program_class

ROWS = 21  # a first chunk of 3 frames


def leads(n: int, seed: int, rows: int = ROWS) -> list[DetokChunk]:
    """n lead windows of `rows` rows (random codes), each a stream's chunk 0."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4096, (n, rows, 1), generator=gen)
    tokens = (128266 + 4096 * (torch.arange(rows) % 7)[None, :, None] + codes).int().numpy().astype("<i4")
    return [
        DetokChunk(f"l{seed}-{i}", 0, 11 + i, tokens[i].tobytes(), LEAD_NOISE_BASE + rows) for i in range(n)
    ]


def test_a_pass_of_first_chunks_decodes_the_same_in_wider_lead_graphs(gpu_report) -> None:
    program = load_program_class("orpheus")(
        get_spec("orpheus"), load_format="dummy", device="cuda", codec_dtype="float16"
    )
    program.load_codec()
    parts = Codec(program, max_batch=128, tails=True)
    wide = Codec(program, max_batch=128, tails=True, lead_batch=128)
    assert parts.limits[ROWS, 0] == LEAD_MAX_BATCH and wide.limits[ROWS, 0] == 128
    chunks = leads(128, seed=1)
    a, b = parts.decode(chunks), wide.decode(chunks)
    worst = max(
        int(np.abs(np.frombuffer(x.pcm, "<i2").astype(int) - np.frombuffer(y.pcm, "<i2").astype(int)).max())
        for x, y in zip(a, b, strict=True)
    )
    report = gpu_report("codec_lead_batch_orpheus")
    report |= {
        "pcm_max_lsb_float16": worst,
        "parts_of_16_pass_ms_float16": codec_pass_ms(parts, chunks),
        "one_graph_of_128_pass_ms_float16": codec_pass_ms(wide, chunks),
    }
    assert [c.rid for c in a] == [c.rid for c in b] and worst == 0, report
