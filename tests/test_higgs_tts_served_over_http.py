"""higgs-tts-tiny served through every process (gateway → tokenizer pool → gpu_worker → codec_worker
with codec streams): the OpenAI endpoint, /generate and the WebSocket (its segment's faded end aside) stream 24 kHz PCM of whole
25 Hz frames for a scene and a system message, the same seed gives the same audio whatever else is
running and whichever endpoint asks, and what the model cannot take is a 400 that names it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from gateway.segments import FADE_S
from tests.conftest import Server
from tests.test_end_to_end_http import pcm_of

FRAME = 960  # samples per 25 Hz frame at 24 kHz
MODEL = "higgs-tts-tiny"
# Random weights never end an utterance: every request runs to max_tokens (prompt included); the
# first 8 + 10 rows are the delay pattern's and the decoder's look-ahead, the rest are frames.
LIMITS = dict(max_tokens=170)


@pytest.fixture(scope="module")
def higgs_server():
    srv = Server("--model", MODEL, "--tokenizer-workers", "1")
    yield srv
    srv.stop()


async def speech(base: str, **body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json={"model": MODEL, **body}) as r:
            return r.status, await r.read()


BODY = dict(input="Hello there, how are you?", response_format="pcm", **LIMITS)


async def test_scenes_and_system_messages_stream_whole_frames(higgs_server):
    bodies = [
        dict(BODY, seed=3),
        dict(BODY, seed=4, scene="SPEAKER0: feminine, warm"),
        dict(BODY, seed=5, system="Generate audio.", scene="A large hall."),
    ]
    results = await asyncio.gather(*(speech(higgs_server.base, **b) for b in bodies))
    for status, pcm in results:
        assert status == 200, pcm
        audio = np.frombuffer(pcm, dtype="<i2")
        assert len(audio) >= 20 * FRAME and len(audio) % FRAME == 0
        assert np.abs(audio.astype(np.int32)).max() > 0
    assert results[0][1] != results[1][1], "the scene is in the prompt"
    again = await speech(higgs_server.base, **bodies[1])
    assert again == results[1], "same seed, same audio, alone or beside other streams"


async def test_generate_and_the_websocket_speak_as_the_openai_endpoint(higgs_server):
    text = "Hello there, how are you?"
    _, want = await speech(higgs_server.base, **dict(BODY, seed=11, input=text))
    async with aiohttp.ClientSession() as s:
        body = {"text": text, "seed": 11, "streaming": False, **LIMITS}
        async with s.post(higgs_server.base + "/generate", json=body) as r:
            assert r.status == 200
            assert pcm_of(await r.read()).tobytes() == want
        async with s.ws_connect(higgs_server.base + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session", "model": MODEL, "seed": 11, **LIMITS})
            await ws.send_json({"type": "append", "text": text})
            await ws.send_json({"type": "end"})
            audio = b""
            while True:
                msg = await ws.receive(timeout=120)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    audio += msg.data
                    continue
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                event = json.loads(msg.data)
                assert event["type"] != "error", event
                if event["type"] == "done":
                    break
    fade = 2 * round(FADE_S * 24000)  # the session fades its segment's end out (gateway/segments.py)
    assert len(audio) == len(want) and audio[:-fade] == want[:-fade]


async def test_what_the_model_cannot_take_is_a_400_naming_it(higgs_server):
    for body, word in (
        (dict(BODY, speed=1.5), "speed"),
        (dict(BODY, language="Klingon"), "language"),
        (dict(BODY, voice="alloy"), "voice"),
        (dict(BODY, emotion="happy"), "emotion"),
    ):
        status, answer = await speech(higgs_server.base, **body)
        assert status == 400, (body, answer)
        assert word in json.loads(answer)["error"]["message"], answer


async def test_the_model_card_lists_the_options(higgs_server):
    async with aiohttp.ClientSession() as s:
        async with s.get(higgs_server.base + "/v1/models") as r:
            card = (await r.json())["data"][0]
    assert card["voices"] == [] and card["sample_rate"] == 24000
    assert {"scene", "system"} <= set(card["options"])
