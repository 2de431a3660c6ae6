"""Clients of vLLM-Omni's and SGLang-Omni's speech API, and LiveKit's and Pipecat's OpenAI TTS
plugins, are served unchanged: `stream`, `language`, `task_type` and `non_streaming_mode` mean what
those servers mean; what a model cannot honour (voice cloning, a language it does not speak) is a
400 naming the model; raw PCM carries its sample rate in `X-Sample-Rate`."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import pytest

from common.config import ServeConfig
from common.messages import FinishReason
from gateway.fields import BadRequest
from gateway.validation import parse_speech, voice_aliases
from tests.specs import model_spec
from tests.test_gateway import SAMPLE_RATE, Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

SPEC = model_spec("orpheus-tiny")
CFG = ServeConfig(model="orpheus-tiny")
SPEAKER = msgspec.structs.replace(SPEC, languages=["English", "Chinese"])  # a model with languages


def _parse(spec: Any = SPEC, **fields: Any) -> Any:
    return parse_speech({"model": "orpheus-tiny", "input": "Hello.", **fields}, spec, CFG)


def test_stream_is_the_chunked_audio_switch_and_may_not_contradict_streaming() -> None:
    assert _parse(stream=True).streaming and not _parse(stream=False).streaming
    assert _parse().streaming  # neither given: voxpipe's default, chunks
    assert not _parse(stream=False, streaming=False).streaming
    with pytest.raises(BadRequest, match="disagree"):
        _parse(stream=True, streaming=False)


def test_language_is_auto_or_one_of_the_models_in_any_case() -> None:
    assert _parse(language="Auto").options == _parse().options  # auto: no option for the program
    assert ("language", "English") in _parse(SPEAKER, language="english").options
    with pytest.raises(BadRequest, match="model orpheus-tiny does not speak 'French'; its languages: auto"):
        _parse(SPEAKER, language="French")
    with pytest.raises(BadRequest, match="model orpheus-tiny does not speak 'English'; its languages: auto$"):
        _parse(language="English")  # a model without a list of languages takes only auto


def test_openai_voice_names_are_aliases_of_the_models_voices_in_order() -> None:
    voices = list(SPEC.voices)  # tara, leah, jess, leo, dan, mia, zac, zoe
    assert voice_aliases(SPEC)["alloy"] == voices[0] and voice_aliases(SPEC)["fable"] == voices[5]
    assert voice_aliases(SPEC)["nova"] == voices[7 % len(voices)]  # round again past the last voice
    assert _parse(voice="shimmer").voice == voices[9 % len(voices)]
    assert _parse(voice="leah").voice == "leah"
    with pytest.raises(BadRequest, match="voices are: tara"):
        _parse(voice="nobody")


def test_what_the_model_cannot_honour_is_a_400_naming_it() -> None:
    for field, value in [("ref_audio", "https://example.com/a.wav"), ("ref_text", "Hello")]:
        with pytest.raises(BadRequest, match="model orpheus-tiny does not clone voices") as err:
            _parse(**{field: value})
        assert err.value.param == field and err.value.status == 400
    with pytest.raises(BadRequest, match="task_type 'Base' is not served by model orpheus-tiny"):
        _parse(task_type="Base")
    with pytest.raises(BadRequest, match="non_streaming_mode false is not available for model orpheus-tiny"):
        _parse(non_streaming_mode=False)
    assert _parse(task_type="CustomVoice", non_streaming_mode=True, ref_audio="", ref_text="").streaming


async def _served(rig: Rig, body: dict[str, Any], pcm: bytes) -> tuple[Any, Any]:
    """POST the speech body, let the fake workers answer its request with `pcm`: → (the request
    the tokenizer pool got, the response)."""
    task = asyncio.ensure_future(rig.client.post("/v1/audio/speech", json=body))
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, pcm, finish=FinishReason.STOP, n_tokens=28, n_prompt_tokens=12)
    return req, await task


async def test_a_vllm_omni_client_gets_chunked_pcm_with_its_sample_rate(rig: Rig) -> None:
    body = {
        "model": "orpheus-tiny",
        "input": "Hello there.",
        "voice": "leo",
        "response_format": "pcm",
        "stream": True,
        "language": "Auto",
        "task_type": "CustomVoice",
        "non_streaming_mode": True,
        "instructions": "",
    }
    pcm = (np.arange(4096) % 200).astype("<i2").tobytes()
    req, resp = await _served(rig, body, pcm)
    assert req.model_kwargs == {"voice": "leo"}
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Sample-Rate"] == str(SAMPLE_RATE)
    assert resp.headers.get("Transfer-Encoding") == "chunked"
    assert await resp.read() == pcm


@pytest.mark.parametrize(
    ("voice", "speaks"),
    [
        ("tara", "tara"),
        ("alloy", "tara"),
        ("ash", "leah"),
        ("verse", "jess"),
    ],  # verse: the 11th of 8, round again
)
async def test_livekit_and_pipecat_shaped_requests_get_raw_pcm(rig: Rig, voice: str, speaks: str) -> None:
    # Both plugins call OpenAI's SDK: model, voice, input, response_format pcm (speed, instructions
    # when set), streamed response. Pipecat's OpenAITTSService sends only OpenAI's voice names and
    # LiveKit's defaults to "ash": each is an alias of one of the model's voices, in order.
    body = {
        "model": "gpt-4o-mini-tts",
        "voice": voice,
        "input": "Hi.",
        "response_format": "pcm",
        "speed": 1.0,
    }
    pcm = (np.arange(2048) % 100).astype("<i2").tobytes()
    req, resp = await _served(rig, body, pcm)
    assert req.model_kwargs["voice"] == speaks
    assert resp.status == 200 and resp.headers["Content-Type"] == "audio/pcm"
    assert resp.headers["X-Sample-Rate"] == str(SAMPLE_RATE) and await resp.read() == pcm


async def test_voice_cloning_over_http_is_an_openai_shaped_400(rig: Rig) -> None:
    body = {
        "model": "orpheus-tiny",
        "input": "Hi.",
        "ref_audio": "data:audio/wav;base64,AAAA",
        "ref_text": "x",
    }
    resp = await rig.client.post("/v1/audio/speech", json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "ref_audio" and error["code"] == "unsupported_value"
    assert "orpheus-tiny does not clone voices" in error["message"]
