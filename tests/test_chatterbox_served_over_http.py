"""chatterbox-tiny served through every process (gateway → tokenizer pool → gpu_worker with
classifier-free guidance → codec_worker with S3Gen's codec streams): the OpenAI endpoint streams
24 kHz PCM of whole one-second windows, the same seed gives the same audio whatever else is running,
and what the model cannot take is a 400 that names it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from tests.conftest import Server

WINDOW = 24000  # samples of a 25-token window at 24 kHz


@pytest.fixture(scope="module")
def chatterbox_server():
    srv = Server("--model", "chatterbox-tiny", "--tokenizer-workers", "1")
    yield srv
    srv.stop()


async def speech(base: str, **body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json={"model": "chatterbox-tiny", **body}) as r:
            return r.status, await r.read()


BODY = dict(input="Hello there, how are you?", response_format="pcm")
PROMPT = 126  # the rows the gateway counts for this text's prompt, which max_tokens counts


async def test_options_stream_whole_windows_side_by_side(chatterbox_server):
    bodies = [
        dict(BODY, seed=3, max_tokens=PROMPT + 55, min_tokens=50),
        dict(BODY, seed=4, max_tokens=PROMPT + 80, min_tokens=75, cfg_weight="0.3"),
        dict(BODY, seed=5, max_tokens=PROMPT + 55, min_tokens=50, exaggeration="1.2"),
    ]
    results = await asyncio.gather(*(speech(chatterbox_server.base, **b) for b in bodies))
    for status, pcm in results:
        assert status == 200, pcm
        audio = np.frombuffer(pcm, dtype="<i2")
        assert len(audio) >= 2 * WINDOW and len(audio) % WINDOW == 0, len(audio)
        assert np.abs(audio.astype(np.int32)).max() > 0


async def test_a_seed_fixes_the_audio(chatterbox_server):
    """One request at a time: on the CPU, T3's speech head rounds by its row count
    (docs/models/chatterbox.md), so a request's tokens may part from its tokens alone late in a
    crowded batch; the codec's windows do not depend on their batch (tests/test_chatterbox_s3gen.py)."""
    body = dict(BODY, seed=4, max_tokens=PROMPT + 55, min_tokens=50, cfg_weight="0.3")
    first = await speech(chatterbox_server.base, **body)
    assert first[0] == 200
    assert await speech(chatterbox_server.base, **body) == first, "same seed, same audio"
    other = await speech(chatterbox_server.base, **dict(body, seed=6))
    assert other[0] == 200 and other[1][: 2 * WINDOW] != first[1][: 2 * WINDOW]


async def test_what_the_model_cannot_take_is_a_400_naming_it(chatterbox_server):
    for body, word in (
        (dict(BODY, speed=1.5), "speed"),
        (dict(BODY, cfg_weight="3"), "cfg_weight"),
        (dict(BODY, exaggeration="x"), "exaggeration"),
    ):
        status, answer = await speech(chatterbox_server.base, **body)
        assert status == 400, (body, answer)
        assert word in json.loads(answer)["error"]["message"], answer
