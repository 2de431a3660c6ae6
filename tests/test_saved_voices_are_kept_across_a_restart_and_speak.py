"""Voice cloning through every process (csm-tiny: gateway → codec_worker's encode service → tokenizer
pool → gpu_worker → codec_worker): a voice saved from a 16 kHz WAV is listed (GET /v1/audio/voices,
/v1/models), speaks by name, equals a request that sends the same clip as `ref_audio`, is kept
across a restart (--voices-dir), and is gone once deleted."""

from __future__ import annotations

import base64
import io
import os
import tempfile

import aiohttp
import numpy as np
import pytest
import soundfile as sf

from tests.conftest import Server

FRAME = 1920


def clip_wav(rate: int = 16000, seconds: float = 0.6, seed: int = 5) -> bytes:
    """A voiced-like clip: a few harmonics with noise, as a 16 kHz WAV (resampled to 24 kHz here)."""
    t = np.arange(int(rate * seconds)) / rate
    rng = np.random.default_rng(seed)
    wave = sum(0.2 / k * np.sin(2 * np.pi * 140 * k * t) for k in range(1, 6)) + 0.02 * rng.standard_normal(
        len(t)
    )
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="module")
def voices_dir():
    with tempfile.TemporaryDirectory(prefix="vp-voices-") as d:
        yield d


def serve(voices_dir: str) -> Server:
    return Server("--model", "csm-tiny", "--tokenizer-workers", "1", "--voices-dir", voices_dir)


async def save(base: str, name: str, wav: bytes, text: str = "A reference.") -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("ref_text", text)
    form.add_field("audio", wav, filename="me.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/voices", data=form) as r:
            return r.status, await r.json()


async def call(base: str, method: str, path: str, **kw) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, base + path, **kw) as r:
            return r.status, await r.read()


async def speech(base: str, **body) -> tuple[int, bytes]:
    body = {
        "model": "csm-tiny",
        "input": "Hello there.",
        "seed": 4,
        "max_tokens": 80,
        "streaming": False,
        **body,
    }
    return await call(base, "POST", "/v1/audio/speech", json=body)


async def test_a_saved_voice_is_listed_speaks_survives_a_restart_and_is_deleted(voices_dir):
    import json

    wav = clip_wav()
    srv = serve(voices_dir)
    try:
        status, card = await save(srv.base, "me", wav)
        assert status == 201, card
        assert card["name"] == "me" and card["model"] == "csm-tiny" and card["ref_text"] == "A reference."
        assert (await save(srv.base, "me", wav))[0] == 409, "a name is saved once"
        assert (await save(srv.base, "3", wav))[0] == 409, "a built-in voice's name is taken"
        status, listed = await call(srv.base, "GET", "/v1/audio/voices")
        assert status == 200 and [v["name"] for v in json.loads(listed)["data"]] == ["me"]
        status, models = await call(srv.base, "GET", "/v1/models")
        card = json.loads(models)["data"][0]
        assert card["saved_voices"] == ["me"] and "me" in card["voices"] and card["voice_cloning"]

        status, by_name = await speech(srv.base, voice="me")
        assert status == 200, by_name
        audio, rate = sf.read(io.BytesIO(by_name), dtype="int16")
        assert rate == 24000 and len(audio) > 0 and len(audio) % FRAME == 0
        # The same clip sent with the request: the same prompt (speaker 0, the default), the same audio.
        inline = "data:audio/wav;base64," + base64.b64encode(wav).decode()
        status, by_clip = await speech(srv.base, voice="0", ref_audio=inline, ref_text="A reference.")
        assert status == 200 and by_clip == by_name
        status, plain = await speech(srv.base, voice="0")
        assert status == 200 and plain != by_name, "the clip changes the prompt, so the audio"
        status, body = await speech(srv.base, voice="nobody")
        assert status == 400 and "nobody" in json.loads(body)["error"]["message"]
    finally:
        srv.stop()
    assert sorted(os.listdir(voices_dir)) == ["me.codes.npy", "me.json"]

    srv = serve(voices_dir)  # a restart reads the directory
    try:
        status, again = await speech(srv.base, voice="me")
        assert status == 200 and again == by_name
        status, body = await call(srv.base, "DELETE", "/v1/audio/voices/me")
        assert status == 200 and json.loads(body)["deleted"]
        assert (await call(srv.base, "DELETE", "/v1/audio/voices/me"))[0] == 404
        assert (await speech(srv.base, voice="me"))[0] == 400
        assert os.listdir(voices_dir) == []
    finally:
        srv.stop()
