"""qwen3-tts-tiny served through every process (gateway → tokenizer pool → gpu_worker → codec_worker
with codec streams): the OpenAI endpoint streams 24 kHz PCM of whole 12 Hz frames for a speaker, a
language, an instruction and either text mode, the same seed gives the same audio whatever else is
running, and what the model cannot take is a 400 that names it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from tests.conftest import Server

FRAME = 1920  # samples per 12.5 Hz frame at 24 kHz


@pytest.fixture(scope="module")
def qwen_server():
    srv = Server("--model", "qwen3-tts-tiny", "--tokenizer-workers", "1")
    yield srv
    srv.stop()


async def speech(base: str, **body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json={"model": "qwen3-tts-tiny", **body}) as r:
            return r.status, await r.read()


BODY = dict(input="Hello there, how are you?", voice="ryan", language="English", response_format="pcm")


async def test_speakers_languages_and_both_text_modes_stream_whole_frames(qwen_server):
    bodies = [
        dict(BODY, seed=3, max_tokens=80, min_tokens=20),
        dict(BODY, seed=4, max_tokens=80, min_tokens=20, non_streaming_mode=False),
        dict(BODY, seed=5, max_tokens=120, min_tokens=20, instructions="Speak softly.", voice="serena"),
    ]
    results = await asyncio.gather(*(speech(qwen_server.base, **b) for b in bodies))
    for status, pcm in results:
        assert status == 200, pcm
        audio = np.frombuffer(pcm, dtype="<i2")
        assert len(audio) >= 20 * FRAME and len(audio) % FRAME == 0
        assert np.abs(audio.astype(np.int32)).max() > 0
    again = await speech(qwen_server.base, **bodies[1])
    assert again == results[1], "same seed, same audio, alone or beside other streams"


async def test_what_the_model_cannot_take_is_a_400_naming_it(qwen_server):
    for body, word in (
        (dict(BODY, voice="nobody"), "voice"),
        (dict(BODY, language="Klingon"), "Klingon"),
        (dict(BODY, speed=1.5), "speed"),
        (dict(BODY, task_type="VoiceDesign"), "task_type"),
    ):
        status, answer = await speech(qwen_server.base, **body)
        assert status == 400, (body, answer)
        assert word in json.loads(answer)["error"]["message"], answer


async def test_the_model_card_lists_voices_languages_and_options(qwen_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(qwen_server.base + "/v1/models") as r:
            card = (await r.json())["data"][0]
    assert "ryan" in card["voices"] and card["default_voice"] == "vivian"
    assert card["languages"][0] == "auto" and "English" in card["languages"]
    assert "non_streaming_mode" in card["options"] and card["sample_rate"] == 24000
