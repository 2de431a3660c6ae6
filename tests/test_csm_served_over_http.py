"""csm-tiny served through every process (gateway → tokenizer pool → gpu_worker → codec_worker):
the OpenAI endpoint returns a 24 kHz WAV of whole Mimi frames for a speaker and a context turn,
and the context option is checked by the program (a bad one is a 400 naming the problem)."""

from __future__ import annotations

import io
import json

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from tests.conftest import Server

FRAME = 1920  # samples per Mimi frame


@pytest.fixture(scope="module")
def csm_server():
    srv = Server("--model", "csm-tiny", "--tokenizer-workers", "1")
    yield srv
    srv.stop()


async def speech(base: str, **body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json={"model": "csm-tiny", **body}) as r:
            return r.status, await r.read()


async def test_a_speaker_with_context_gets_a_wav_of_whole_mimi_frames(csm_server):
    context = [
        {
            "speaker": 0,
            "text": "Hi there.",
            "codes": [[(7 * f + k) % 2048 for k in range(32)] for f in range(6)],
        }
    ]
    body = dict(
        input="Hello.", voice="1", context=json.dumps(context), seed=3, max_tokens=60, streaming=False
    )
    status, wav = await speech(csm_server.base, **body)
    assert status == 200, wav
    audio, rate = sf.read(io.BytesIO(wav), dtype="int16")
    assert rate == 24000
    assert len(audio) > 0 and len(audio) % FRAME == 0
    assert np.abs(audio.astype(np.int32)).max() > 0
    again_status, again = await speech(csm_server.base, **body)
    assert again_status == 200 and again == wav, "same seed, same audio"


async def test_a_context_turn_without_audio_is_a_400_that_says_so(csm_server):
    status, body = await speech(
        csm_server.base, input="Hello.", context=json.dumps([{"speaker": 0, "text": "no audio"}])
    )
    assert status == 400
    assert "codes" in json.loads(body)["error"]["message"]
