"""`POST /v1/audio/speech` and `GET /v1/models`, OpenAI's API, over real HTTP and real ZMQ with the
test playing the workers (the rig of tests/test_gateway.py)."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import numpy as np
import pytest
import soundfile as sf

from common.messages import FinishReason
from gateway.encoders import available_formats
from tests.test_gateway import MAX_TEXT, SAMPLE_RATE, Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

CHUNK = 2048


def _tone(n: int, start: int = 0, freq: float = 440.0) -> bytes:
    t = (np.arange(start, start + n)) / SAMPLE_RATE
    return (8000 * np.sin(2 * np.pi * freq * t)).astype("<i2").tobytes()


def _decode(fmt: str, data: bytes) -> np.ndarray:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2")
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SAMPLE_RATE and audio.ndim == 1
    return audio


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


def _speech(rig: Rig, **body: Any) -> asyncio.Task:
    """Start a POST /v1/audio/speech; it completes once the gateway has its first event."""
    return asyncio.create_task(rig.client.post("/v1/audio/speech", json={"model": "orpheus-tiny", **body}))


async def _serve(rig: Rig, n_chunks: int = 3, **body: Any) -> tuple[Any, bytes, bytes]:
    """One request answered with `n_chunks` tone chunks: (response, body, the PCM sent)."""
    task = _speech(rig, input="Hello there.", **body)
    req = await rig.workers.next_request()
    pcm = [_tone(CHUNK, i * CHUNK) for i in range(n_chunks)]
    await rig.workers.audio(
        req.rid, *pcm, finish=FinishReason.STOP, n_tokens=28 + 7 * (n_chunks - 1), n_prompt_tokens=12
    )
    resp = await task
    return resp, await resp.read(), b"".join(pcm)


def test_this_build_encodes_every_format_the_endpoint_offers() -> None:
    # libsndfile 1.1+ ships MP3 (LAME/mpg123) and Opus; aac is the one OpenAI format it lacks.
    assert available_formats(SAMPLE_RATE) == ("mp3", "opus", "flac", "wav", "pcm")


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
async def test_every_response_format_decodes_with_libsndfile(rig: Rig, fmt: str, streaming: bool) -> None:
    resp, body, pcm = await _serve(rig, response_format=fmt, streaming=streaming)
    assert resp.status == 200, body
    sent = np.frombuffer(pcm, dtype="<i2")
    audio = _decode(fmt, body)
    if fmt in ("wav", "pcm", "flac"):  # lossless
        assert np.array_equal(audio, sent)
    else:  # lossy: the encoder's delay and padding add at most a few frames
        assert len(sent) <= len(audio) <= len(sent) + 4096
        assert 0.7 < _rms(audio) / _rms(sent) < 1.3
    whole = not streaming or fmt == "flac"
    assert (resp.headers.get("Content-Length") == str(len(body))) == whole
    assert (resp.headers.get("Transfer-Encoding") == "chunked") == (not whole)


@pytest.mark.parametrize(
    "fmt, content_type",
    [("wav", "audio/wav"), ("pcm", "audio/pcm"), ("mp3", "audio/mpeg"), ("opus", "audio/ogg; codecs=opus")],
)
async def test_streamable_formats_send_audio_before_generation_ends(
    rig: Rig, fmt: str, content_type: str
) -> None:
    task = _speech(rig, input="Hello there.", response_format=fmt)
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _tone(CHUNK), _tone(CHUNK, CHUNK))
    resp = await task
    assert resp.status == 200 and resp.headers["Content-Type"] == content_type
    first = await asyncio.wait_for(resp.content.readany(), 5)  # while the request is still running
    assert first
    await rig.workers.audio(req.rid, _tone(CHUNK, 2 * CHUNK), finish=FinishReason.STOP)
    assert len(_decode(fmt, first + await resp.read())) >= 3 * CHUNK


async def test_flac_is_sent_whole_once_the_audio_is_complete(rig: Rig) -> None:
    task = _speech(rig, input="Hello there.", response_format="flac")
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _tone(CHUNK))
    await asyncio.sleep(0.2)
    assert not task.done()  # no headers yet: the FLAC header holds the length
    await rig.workers.audio(req.rid, _tone(CHUNK, CHUNK), finish=FinishReason.STOP)
    resp = await task
    body = await resp.read()
    assert resp.headers["Content-Type"] == "audio/flac" and int(resp.headers["Content-Length"]) == len(body)
    assert np.array_equal(_decode("flac", body), np.frombuffer(_tone(2 * CHUNK), dtype="<i2"))


async def test_default_response_format_is_mp3_as_openai_does(rig: Rig) -> None:
    resp, body, pcm = await _serve(rig)
    assert resp.headers["Content-Type"] == "audio/mpeg"
    assert len(_decode("mp3", body)) >= len(pcm) // 2


def _events(body: bytes) -> list[dict[str, Any]]:
    """Server-sent events: each `data:` line's JSON; nothing else in the stream."""
    blocks = body.decode().split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(json.loads(block[len("data: ") :]))
    return out


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
async def test_sse_stream_carries_base64_audio_deltas_then_a_done_event_with_usage(
    rig: Rig, fmt: str
) -> None:
    resp, body, pcm = await _serve(rig, stream_format="sse", response_format=fmt, n_chunks=3)
    assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
    events = _events(body)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert len(events) >= 3 and all(set(e) == {"type", "audio"} for e in events[:-1])
    assert events[-1] == {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 12, "output_tokens": 42, "total_tokens": 54},
    }
    audio = _decode(fmt, b"".join(base64.b64decode(e["audio"]) for e in events[:-1]))
    if fmt == "pcm":
        assert audio.tobytes() == pcm


async def test_sse_reports_a_failure_after_audio_as_an_error_event(rig: Rig) -> None:
    task = _speech(rig, input="Hello.", stream_format="sse", response_format="pcm")
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _tone(CHUNK))
    await rig.workers.audio(req.rid, finish=FinishReason.ERROR, status=500, message="codec died")
    resp = await task
    events = _events(await resp.read())
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1] == {
        "type": "error",
        "error": {"message": "codec died", "type": "server_error", "param": None, "code": "internal_error"},
    }


async def test_speech_request_carries_voice_extras_and_model_defaults(rig: Rig) -> None:
    task = _speech(
        rig, model="TTS-1", input="Hi there", voice="zoe", speed=1.0, seed=7, temperature=0.3, max_tokens=200
    )
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _tone(CHUNK), finish=FinishReason.STOP)
    assert (await task).status == 200
    assert (req.text, req.model_kwargs) == ("Hi there", {"voice": "zoe"})
    s = req.sampling
    assert (s.seed, s.temperature, s.max_tokens, s.top_p, s.repetition_penalty) == (7, 0.3, 200, 0.8, 1.3)


_BAD: list[tuple[dict[str, Any], int, str, str | None, str]] = [
    # body, status, code, param, text in the message
    ({"input": "hi"}, 400, "missing_required_parameter", "model", "field 'model' is required"),
    ({"model": "gpt-5", "input": "hi"}, 404, "model_not_found", "model", "this server serves orpheus-tiny"),
    ({"model": "orpheus", "input": "hi"}, 404, "model_not_found", "model", "see GET /v1/models"),
    ({"model": "tts-1"}, 400, "missing_required_parameter", "input", "field 'input' is required"),
    (
        {"model": "tts-1", "input": "a" * (MAX_TEXT + 1)},
        400,
        "invalid_value",
        "input",
        f"the limit is {MAX_TEXT}",
    ),
    ({"model": "tts-1", "input": "hi", "voice": "nobody"}, 400, "invalid_value", "voice", "voices are: tara"),
    ({"model": "tts-1", "input": "hi", "speed": 1.5}, 400, "unsupported_value", "speed", "cannot change"),
    ({"model": "tts-1", "input": "hi", "speed": "fast"}, 400, "unsupported_value", "speed", "must be 1.0"),
    (
        {"model": "tts-1", "input": "hi", "response_format": "aac"},
        400,
        "unsupported_value",
        "response_format",
        "AAC",
    ),
    (
        {"model": "tts-1", "input": "hi", "response_format": "ogg"},
        400,
        "invalid_value",
        "response_format",
        "mp3, opus",
    ),
    (
        {"model": "tts-1", "input": "hi", "stream_format": "raw"},
        400,
        "invalid_value",
        "stream_format",
        "audio, sse",
    ),
    (
        {"model": "tts-1", "input": "hi", "stream_format": "sse", "streaming": False},
        400,
        "invalid_value",
        "streaming",
        "always streams",
    ),
    (
        {"model": "tts-1", "input": "hi", "instructions": "whisper"},
        400,
        "invalid_value",
        "instructions",
        "leave",
    ),
    ({"model": "tts-1", "input": "hi", "temperature": 9}, 400, "invalid_value", "temperature", "[0, 2]"),
    (
        {"model": "tts-1", "input": "hi", "streamed": True},
        400,
        "unknown_parameter",
        "streamed",
        "accepted fields",
    ),
]


@pytest.mark.parametrize("body, status, code, param, text", _BAD, ids=[c[4] for c in _BAD])
async def test_bad_speech_requests_get_openai_shaped_errors(
    rig: Rig, body: dict[str, Any], status: int, code: str, param: str | None, text: str
) -> None:
    resp = await rig.client.post("/v1/audio/speech", json=body)
    assert resp.status == status
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)
    assert text in error["message"], error["message"]


async def test_body_and_routing_errors_under_v1_keep_the_openai_shape(rig: Rig) -> None:
    resp = await rig.client.post("/v1/audio/speech", data="{", headers={"Content-Type": "application/json"})
    assert resp.status == 400 and "not valid JSON" in (await resp.json())["error"]["message"]
    resp = await rig.client.get("/v1/audio/speech")
    assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"
    resp = await rig.client.get("/v1/nothing")
    assert resp.status == 404 and (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await rig.client.post("/generate", json={})  # /generate keeps its own shape
    assert resp.status == 400 and isinstance((await resp.json())["error"], str)


async def test_models_lists_the_served_model_with_its_voices_and_sample_rate(rig: Rig) -> None:
    resp = await rig.client.get("/v1/models")
    body = await resp.json()
    assert resp.status == 200 and body["object"] == "list" and len(body["data"]) == 1
    model = body["data"][0]
    assert (model["id"], model["object"], model["owned_by"]) == ("orpheus-tiny", "model", "voxpipe")
    assert model["voices"] == ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
    assert (model["default_voice"], model["sample_rate"], model["max_tokens"]) == ("tara", SAMPLE_RATE, 400)
    assert model["max_input_chars"] == MAX_TEXT and "tts-1" in model["aliases"]
    assert model["response_formats"] == list(available_formats(SAMPLE_RATE))
    one = await rig.client.get("/v1/models/tts-1")
    assert one.status == 200 and await one.json() == model
    missing = await rig.client.get("/v1/models/canopylabs/orpheus-3b-0.1-ft")
    assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"
