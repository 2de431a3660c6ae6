"""Through every process: HTTP → gateway → tokenizer pool → gpu_worker → codec_worker → HTTP."""

from __future__ import annotations

import asyncio
import io
import struct

import aiohttp
import numpy as np
import soundfile as sf

from tests.conftest import get_json

CHUNK = 2048  # samples each Orpheus window adds


async def generate(session: aiohttp.ClientSession, base: str, **body) -> tuple[int, dict, bytes]:
    async with session.post(base + "/generate", json=body) as r:
        return r.status, dict(r.headers), await r.read()


def pcm_of(wav: bytes) -> np.ndarray:
    return np.frombuffer(wav[44:], dtype="<i2")


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal length and equal samples up to one PCM16 step: the codec batches chunks of different
    requests together, and a convolution over another batch size may round its last float bit the
    other way, which truncation to int16 can turn into 1 step (3e-5 of full scale)."""
    return len(a) == len(b) and int(np.abs(a.astype(np.int32) - b.astype(np.int32)).max(initial=0)) <= 1


async def test_streaming_and_complete_wavs_decode_at_24khz(server):
    async with aiohttp.ClientSession() as s:
        status, headers, streamed = await generate(
            s, server.base, text="Hello there.", seed=5, max_tokens=120
        )
        assert status == 200, streamed
        assert headers["Content-Type"] == "audio/wav"
        assert struct.unpack("<I", streamed[4:8])[0] == 0xFFFFFFFF  # RIFF size unknown while streaming
        assert struct.unpack("<I", streamed[40:44])[0] == 0xFFFFFFFF
        status, headers, whole = await generate(
            s, server.base, text="Hello there.", seed=5, max_tokens=120, streaming=False
        )
        assert status == 200, whole
        assert int(headers["Content-Length"]) == len(whole)
    audio, rate = sf.read(io.BytesIO(whole), dtype="int16")
    assert rate == 24000
    # Constrained sampling: every token is audio, a window every 7 tokens after the first 28.
    assert len(audio) > 0 and len(audio) % CHUNK == 0
    assert same_audio(audio, pcm_of(streamed)), "same seed, streaming or not: same audio"
    assert np.abs(audio.astype(np.int32)).max() > 0


async def test_a_seed_gives_the_same_audio_alone_and_among_concurrent_requests(server):
    async with aiohttp.ClientSession() as s:
        _, _, alone = await generate(s, server.base, text="The same words.", seed=42, max_tokens=150)
        others = [
            generate(s, server.base, text="x " * (3 + 5 * i), seed=1000 + i, max_tokens=100 + 20 * i)
            for i in range(7)
        ]
        results = await asyncio.gather(
            generate(s, server.base, text="The same words.", seed=42, max_tokens=150), *others
        )
    assert all(code == 200 for code, _, _ in results)
    assert len(pcm_of(alone)) > 0
    assert same_audio(pcm_of(results[0][2]), pcm_of(alone))
    assert not same_audio(pcm_of(results[1][2])[: len(pcm_of(alone))], pcm_of(alone))


async def test_form_requests_and_bad_input_leave_the_server_serving(server):
    async with aiohttp.ClientSession() as s:
        form = aiohttp.FormData(
            {"text": "A form request.", "voice": "leo", "streaming": "false", "max_tokens": "80"}
        )
        async with s.post(server.base + "/generate", data=form) as r:
            assert r.status == 200
            assert "X-Request-Id" in r.headers
        for body in ({"text": ""}, {"text": "hi", "voice": "nobody"}, {"text": "hi", "temperature": "hot"}):
            status, _, payload = await generate(s, server.base, **body)
            assert 400 <= status < 500, payload
        # A prompt longer than max_tokens allows is refused by the prompt builder with a 400.
        status, _, payload = await generate(s, server.base, text="word " * 300, max_tokens=30)
        assert status == 400 and b"max_tokens" in payload
        status, _, _ = await generate(s, server.base, text="Still serving.", max_tokens=60)
        assert status == 200


def test_ready_lists_every_process(server):
    code, body = get_json(server.base + "/ready")
    assert code == 200 and body["ready"] is True
    roles = sorted(p["role"] for p in body["processes"])
    assert roles == ["codec_worker", "gateway", "gpu_worker", "tokenizer_worker", "tokenizer_worker"]
    assert all(p["pid"] > 0 for p in body["processes"])
