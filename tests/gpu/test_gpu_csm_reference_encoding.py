"""CSM's reference encoder on the GPU (dummy csm-1b Mimi weights, fp32 with TF32 off): the codes the
codec_worker's encode service gives a batch of clips equal transformers' `MimiModel.encode` of each
clip alone on the same GPU, and the time one encode pass takes (8 clips, 30 s of audio in all: the
longest a codec window may wait behind an encode, codec_worker/encode.py).

    python -m pytest tests/gpu/test_gpu_csm_reference_encoding.py -s
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from codec_worker.encode import ENCODE_MAX_CLIPS, ENCODE_PASS_SECONDS, Encodes
from common.arrays import np_array, wire_array
from common.messages import EncodeRequest
from programs import get_spec, load_program_class

RATE = 24000


@pytest.fixture(scope="module")
def program():
    p = load_program_class("csm")(get_spec("csm"), load_format="dummy", device="cuda")
    p.load_codec()
    p.load_encoders()
    return p


def clips(seconds: list[float]) -> list[EncodeRequest]:
    rng = np.random.default_rng(0)
    return [
        EncodeRequest(f"c{i}", wire_array((0.3 * rng.standard_normal(int(RATE * s))).astype(np.float32)))
        for i, s in enumerate(seconds)
    ]


def test_batched_codes_equal_transformers_encode_of_each_clip(program, gpu_report) -> None:
    encodes = Encodes(program)
    batch = clips([0.7, 3.1, 1.0, 5.2])
    replies = encodes.encode(batch)
    model = program.codec.model
    agree, total = 0, 0
    for req, reply in zip(batch, replies, strict=True):
        assert not reply.error, reply.error
        audio = torch.from_numpy(np_array(req.audio).copy()).cuda()[None, None]
        with torch.no_grad():
            want = model.encode(audio.to(next(model.parameters()).dtype)).audio_codes[0].T.cpu().numpy()
        got = np_array(reply.features["codes"])
        assert got.shape == want.shape
        agree += int((got == want).all(axis=1).sum())
        total += len(want)
    print(f"frames whose 32 codes equal transformers': {agree}/{total}")
    gpu_report("csm-reference-encode").update(frames_equal=agree, frames=total)
    assert agree == total


def test_one_encode_pass_of_a_full_batch_takes_little_of_a_frame(program, gpu_report) -> None:
    encodes = Encodes(program)
    per = ENCODE_PASS_SECONDS / ENCODE_MAX_CLIPS
    for _ in range(2):  # warm up
        encodes.encode(clips([per] * ENCODE_MAX_CLIPS))
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        encodes.encode(clips([per] * ENCODE_MAX_CLIPS))
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - t0))
    ms = float(np.median(times))
    print(f"encode pass: {ENCODE_MAX_CLIPS} clips, {ENCODE_PASS_SECONDS:g} s of audio: {ms:.1f} ms")
    gpu_report("csm-reference-encode").update(pass_ms=ms, clips=ENCODE_MAX_CLIPS, audio_s=ENCODE_PASS_SECONDS)
