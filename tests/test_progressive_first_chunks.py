"""`--first-chunk progressive`: a request's first frames go out one by one as tail windows (the
newest frame, decoded after up to three frames of context), until the audio already sent covers
the wait for the next regular window; after that, the reference's windows, unchanged."""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest
import soundfile as sf
import torch

from codec_worker.worker import Codec
from common.messages import LEAD_NOISE_BASE, DetokChunk, Prompt, SamplingParams
from gpu_worker.engine import Engine, EngineLimits
from programs import get_spec, load_program_class, rng
from tests.conftest import Server

PROMPT = [128259, 300, 301, 302, 128009, 128260, 128261, 128257]
FRAME_S = 2048 / 24000


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")
    p.load_lm()
    p.load_codec()
    return p


def chunks_of(program, first_chunk: str, step_s: float) -> list[DetokChunk]:
    eng = Engine(program, EngineLimits(max_batch_size=4, max_context=200, first_chunk=first_chunk))
    for _ in range(10):
        eng.clock.record(1, step_s)  # the pace the engine believes it steps at
    eng.clock.tick = lambda batch: None  # keep it there (the CPU's real pace would vary)
    rows = np.array(PROMPT, dtype="<i4")
    sp = SamplingParams(max_tokens=150, min_tokens=130, constrained=True, seed=3)
    eng.add(Prompt("r", rows.tobytes(), len(rows), sp))
    return [c for batch in eng.run_until_idle() for c in batch.chunks]


@pytest.mark.parametrize("step_ms, n_tails", [(3.0, 1), (8.0, 7)])
def test_tails_until_the_stream_is_ahead_then_the_reference_windows(program, step_ms, n_tails):
    ref = chunks_of(program, "reference", step_ms / 1000)
    got = chunks_of(program, "progressive", step_ms / 1000)
    tails = [c for c in got if c.tail_rows]
    # Switch after tail k once (k + 1) frames outlast the wait to window k: (7k + 21) steps of
    # 1.15 s. At 3 ms a step the first frame does; at 8 ms it takes seven (k >= 5.2).
    assert len(tails) == n_tails and got[:n_tails] == tails
    assert [len(c.tokens) // 4 for c in tails] == [min(28, 7 * (k + 1)) for k in range(n_tails)]
    assert [c.index for c in got] == list(range(len(got)))
    # Tail k is frame k; regular window j is frame j + 1: the rest are the reference's from frame
    # n_tails on, same tokens and noise streams.
    rest = [(c.tokens, c.noise_id) for c in got[n_tails:]]
    assert rest == [(c.tokens, c.noise_id) for c in ref[n_tails - 1 :]]
    full = np.concatenate([np.frombuffer(c.tokens, "<i4") for c in ref])  # windows overlap
    assert np.frombuffer(tails[0].tokens, "<i4").tolist() == full[:7].tolist()


def test_a_slow_engine_keeps_sending_tails(program):
    got = chunks_of(program, "progressive", 0.013)  # slower than real time: never far enough ahead
    assert all(c.tail_rows == 7 for c in got)


def test_a_tail_window_is_the_newest_frame_of_its_window_decoded_whole(program):
    codec = Codec(program, max_batch=4, graphs=False, tails=True)
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for k, rows in enumerate((7, 14, 21, 28, 28)):
        tokens = 128266 + 4096 * (torch.arange(rows) % 7) + torch.randint(1, 4096, (rows,), generator=gen)
        noise = LEAD_NOISE_BASE + rows if k < 4 else 1
        chunks.append(DetokChunk("r", k, 9, tokens.int().numpy().astype("<i4").tobytes(), noise, tail_rows=7))
    out = codec.decode(chunks)
    assert [len(a.pcm) // 2 for a in out] == [2048] * 5
    for c, a in zip(chunks, out, strict=True):
        rows = len(c.tokens) // 4
        t = torch.from_numpy(np.frombuffer(c.tokens, "<i4").astype(np.int64)).view(1, rows, 1)
        keys = rng.mix_keys(torch.tensor([c.seed]), torch.tensor([c.noise_id]))
        levels, _ = program.codec.window_levels(t)
        whole = program.codec.decode_codes(levels, keys, crop=False)[0, 0]  # every sample of the window
        want = np.clip(np.round(whole[-2048:].numpy() * 32767), -32768, 32767)
        np.testing.assert_allclose(np.frombuffer(a.pcm, "<i2").astype(int), want.astype(int), atol=1)


def test_progressive_mode_serves_whole_wavs_through_every_process():
    srv = Server("--first-chunk", "progressive")
    try:
        body = json.dumps({"text": "Frame by frame.", "seed": 4, "max_tokens": 120, "streaming": False})
        req = urllib.request.Request(
            srv.base + "/generate", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            audio, rate = sf.read(io.BytesIO(r.read()), dtype="int16")
        assert rate == 24000 and len(audio) > 0 and len(audio) % 2048 == 0
    finally:
        srv.stop()
