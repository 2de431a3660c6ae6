"""Reference clips at the gateway, over real HTTP and ZMQ, the test playing the other processes (the
codec_worker's side runs the real encode service, csm-tiny's Mimi encoder): every bad clip is a
clear 400 that reaches no worker; a clip at another rate is resampled; a repeated clip is encoded
once, concurrent requests sharing one encode; a missing or dying codec_worker is a 503; a failed
encode leaves nothing held; and a slow encode does not hold up another request's stream."""

# ruff: noqa: F811 (fixtures from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
import soundfile as sf
from aiohttp.test_utils import TestClient, TestServer

from codec_worker.encode import Encodes
from common.config import GatewaySettings, ServeConfig, TokenizerSettings
from common.ipc import Addresses, AsyncPullChannel
from common.messages import (
    CodecInMsg,
    EncodeReply,
    EncodeRequest,
    FinishReason,
    GenerateRequest,
    ProcState,
    PromptSize,
)
from gateway.server import GATEWAY, build_app
from programs import get_spec
from programs.csm.program import CsmProgram
from tests.test_gateway import FakeWorkers, Rig, _pcm, make_addrs, rig, start_rig  # noqa: F401

RATE = 24000


def wav(
    seconds: float = 0.5, rate: int = RATE, channels: int = 1, peak: float = 0.4, fmt: str = "WAV"
) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    mono = peak * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    data = np.stack([mono * (1 - 0.3 * c) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    sf.write(buf, data.astype(np.float32), rate, format=fmt)
    return buf.getvalue()


class FakeCodec:
    """The codec_worker's side of codec_in: the real encode service, answering as told."""

    def __init__(self, addrs: Addresses, workers: FakeWorkers, program: CsmProgram) -> None:
        self.inbox = AsyncPullChannel[CodecInMsg](addrs.codec_in, CodecInMsg, bind=True)
        self.workers = workers
        self.encodes = Encodes(program)
        self.received: list[EncodeRequest] = []
        self.delay_s = 0.0
        self.answer = True  # False: take clips and never reply (a hung or dying worker)
        self.error = ""  # reply with this error instead of features
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            req = await self.inbox.recv()
            assert isinstance(req, EncodeRequest)
            self.received.append(req)
            if not self.answer:
                continue
            await asyncio.sleep(self.delay_s)
            if self.error:
                await self.workers.send(EncodeReply(req.key, error=self.error, status=500))
                continue
            self.encodes.add(req)
            for reply in self.encodes.encode(self.encodes.take()):
                await self.workers.send(reply)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.inbox.close()


@pytest.fixture(scope="module")
def csm() -> CsmProgram:
    p = CsmProgram(get_spec("csm-tiny"), load_format="dummy")
    p.load_codec()
    p.load_encoders()
    return p


@pytest.fixture
async def clone_rig(
    make_addrs: Callable[[], Addresses], csm: CsmProgram
) -> AsyncIterator[tuple[Rig, FakeCodec]]:
    addrs = make_addrs()
    workers = FakeWorkers(addrs)
    gateway = GatewaySettings(max_text_chars=200, max_reference_bytes=200_000, max_reference_seconds=2.0)
    cfg = ServeConfig(
        model="csm-tiny", tokenizer=TokenizerSettings(workers=1), gateway=gateway, addresses=addrs
    )
    client = TestClient(TestServer(build_app(cfg)))
    await client.start_server()
    await workers.join_gpu_pool(client.app)
    await workers.announce(client.app, cfg.model)
    codec = FakeCodec(addrs, workers, csm)
    await workers.status("codec_worker", "codec_worker")
    deadline = time.monotonic() + 5
    while not client.app[GATEWAY].procs.ready("codec_worker"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    yield Rig(client, workers, cfg), codec
    await codec.close()
    await client.close()
    workers.close()


def form(audio: bytes | None, **fields: str) -> aiohttp.FormData:
    f = aiohttp.FormData()
    for k, v in {"text": "Hello.", **fields}.items():
        f.add_field(k, v)
    if audio is not None:
        f.add_field("audio", audio, filename="ref.wav", content_type="audio/wav")
    return f


def speech(**body: Any) -> dict[str, Any]:
    return {"json": {"model": "csm-tiny", "input": "Hello.", **body}}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def error_of(resp: aiohttp.ClientResponse) -> str:
    body = await resp.json()
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


BAD = [
    ("/generate", {"data": form(b"this is plain text, no audio")}, "not audio this server can decode"),
    ("/generate", {"data": form(wav(seconds=6))}, "larger than 200000 bytes"),
    ("/generate", {"data": form(wav(seconds=3, rate=8000))}, "3.0 s long; the limit is 2 s"),
    ("/generate", {"data": form(b"")}, "the reference clip is empty"),
    ("/generate", {"data": form(wav(seconds=0.04))}, "shorter than 0.1 s"),
    ("/generate", {"data": form(wav(peak=0.0))}, "silent"),
    ("/generate", {"data": form(None, ref_text="words")}, "send the clip with it"),
    ("/generate", {"json": {"text": "Hello.", "audio": b64(wav())}}, "send it as a file in a multipart form"),
    ("/generate", {"json": {"text": "Hello.", "voice": "nobody"}}, "unknown voice 'nobody'"),
    ("/v1/audio/speech", speech(ref_audio="@@@not base64@@@"), "not base64 audio"),
    ("/v1/audio/speech", speech(ref_audio="https://example.com/me.wav"), "fetches no URL"),
    ("/v1/audio/speech", speech(ref_audio="data:audio/wav," + b64(wav())), "without base64 data"),
    ("/v1/audio/speech", speech(ref_audio=b64(wav(seconds=6))), "larger than 200000 bytes"),
    (
        "/v1/audio/speech",
        speech(ref_audio=b64(b"RIFF....WAVEfmt garbage")),
        "not audio this server can decode",
    ),
    ("/v1/audio/speech", speech(ref_audio=b64(wav(peak=0.0))), "silent"),
    ("/v1/audio/speech", speech(ref_text="words"), "send the clip with it"),
    ("/v1/audio/speech", speech(voice="nobody"), "unknown voice 'nobody'"),
]


@pytest.mark.parametrize("path,kwargs,message", BAD, ids=[m for _, _, m in BAD])
async def test_each_bad_clip_is_a_clear_400_that_reaches_no_worker(clone_rig, path, kwargs, message) -> None:
    rig, codec = clone_rig
    resp = await rig.client.post(path, **kwargs)
    assert resp.status == 400, await resp.text()
    assert message in await error_of(resp)
    assert not codec.received, "no clip went to be encoded"
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(rig.workers.recv_requests.recv(), 0.1)


async def test_a_model_that_does_not_clone_refuses_a_clip(rig) -> None:
    resp = await rig.client.post("/generate", data=form(wav()))
    assert resp.status == 400 and "orpheus-tiny does not clone voices" in await error_of(resp)
    body = {"model": "orpheus-tiny", "input": "Hi.", "ref_audio": b64(wav())}
    resp = await rig.client.post("/v1/audio/speech", json=body)
    assert resp.status == 400 and "does not clone voices" in await error_of(resp)
    voice = aiohttp.FormData({"name": "me"})
    voice.add_field("audio", wav(), filename="me.wav")
    resp = await rig.client.post("/v1/audio/voices", data=voice)
    assert resp.status == 400 and "does not clone voices" in await error_of(resp)


async def answer(rig: Rig, n: int) -> list[GenerateRequest]:
    """Take n requests off the tokenizer pool and finish each at once (a cloned voice's request is
    sized first: its sizing gets an answer too)."""
    reqs: list[GenerateRequest] = []
    while len(reqs) < n:
        req = await rig.workers.next_request()
        if req.size_only:
            await rig.workers.send(PromptSize(req.rid, 20))
            continue
        await rig.workers.audio(req.rid, _pcm(1920), finish=FinishReason.STOP)
        reqs.append(req)
    return reqs


async def test_a_repeated_clip_is_encoded_once_and_resampled_to_the_models_rate(clone_rig, csm) -> None:
    rig, codec = clone_rig
    clip = wav(seconds=0.5, rate=16000, channels=2)  # stereo at 16 kHz: mixed down, resampled
    posts = [
        asyncio.create_task(rig.client.post("/generate", data=form(clip, ref_text="Hi."))) for _ in range(3)
    ]
    reqs = await answer(rig, 3)
    assert [(await p).status for p in posts] == [200] * 3
    assert len(codec.received) == 1, "three requests at once share one encode"
    [sent] = codec.received
    assert sent.audio.shape == [12000] and sent.text == "Hi."  # 0.5 s at 24 kHz, one channel
    codes = {r.voice.features["codes"].data for r in reqs}
    assert len(codes) == 1 and all(r.voice.text == "Hi." for r in reqs)
    assert reqs[0].model_kwargs == {"voice": "0"}
    # later, as base64 on the OpenAI endpoint: from the cache, no encode at all
    post = asyncio.create_task(
        rig.client.post("/v1/audio/speech", **speech(ref_audio=b64(clip), stream=False))
    )
    [req] = await answer(rig, 1)
    assert (await post).status == 200
    assert len(codec.received) == 1 and req.voice.features["codes"].data in codes
    assert rig.client.app[GATEWAY].references.encodes_sent == 1


async def test_no_ready_codec_worker_is_a_503_and_one_that_dies_fails_its_clips(clone_rig) -> None:
    rig, codec = clone_rig
    codec.answer = False
    post = asyncio.create_task(rig.client.post("/generate", data=form(wav())))
    deadline = time.monotonic() + 5
    while not codec.received:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await rig.workers.status("codec_worker", "codec_worker", ProcState.FAILED)
    resp = await post
    assert resp.status == 503 and "codec_worker stopped while encoding" in await error_of(resp)
    resp = await rig.client.post("/generate", data=form(wav(seconds=0.7)))
    assert resp.status == 503 and "no codec_worker is ready" in await error_of(resp)
    assert len(codec.received) == 1


async def test_a_failed_encode_leaves_nothing_held(clone_rig) -> None:
    rig, codec = clone_rig
    codec.error = "encoder error: RuntimeError: out of memory"
    resp = await rig.client.post("/v1/audio/speech", **speech(ref_audio=b64(wav())))
    assert resp.status == 500 and "out of memory" in await error_of(resp)
    gateway = rig.client.app[GATEWAY]
    assert gateway._pending == {} and gateway.admission.active == 0 and not gateway.references._inflight
    with pytest.raises(asyncio.TimeoutError):  # nothing was submitted: no prompt, no KV pages
        await asyncio.wait_for(rig.workers.recv_requests.recv(), 0.1)
    codec.error = ""  # the same clip again: encoded now (a failure is not cached)
    post = asyncio.create_task(
        rig.client.post("/v1/audio/speech", **speech(ref_audio=b64(wav()), stream=False))
    )
    await answer(rig, 1)
    resp = await post
    assert resp.status == 200 and len(codec.received) == 2, await resp.text()


async def test_a_slow_encode_does_not_hold_up_another_requests_stream(clone_rig) -> None:
    rig, codec = clone_rig
    stream = asyncio.create_task(rig.client.post("/generate", json={"text": "Go on."}))
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(480))
    resp = await stream
    await resp.content.readexactly(44 + 960)  # header and the first chunk
    codec.delay_s = 0.8  # the clip's encode takes 0.8 s
    cloning = asyncio.create_task(rig.client.post("/generate", data=form(wav(), streaming="false")))
    gaps, last = [], time.monotonic()
    for i in range(30):  # a chunk every 20 ms for 0.6 s, while the clip is being encoded
        await rig.workers.audio(req.rid, _pcm(480, 480 * (i + 1)))
        await resp.content.readexactly(960)
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        await asyncio.sleep(0.02)
    assert not cloning.done(), "the clip is still being encoded"
    # an encode on the event loop would stop the stream for its 0.8 s; half that leaves room for a
    # busy 2-core machine's scheduling
    assert max(gaps) < 0.4, f"the stream kept its cadence while the clip was encoded: {max(gaps):.3f} s"
    await rig.workers.audio(req.rid, finish=FinishReason.STOP)
    [cloned] = await answer(rig, 1)
    assert cloned.voice is not None and (await cloning).status == 200


async def test_the_openapi_document_of_a_cloning_model_has_the_clip_and_voices(clone_rig) -> None:
    rig, _ = clone_rig
    doc = await (await rig.client.get("/openapi.json")).json()
    paths = doc["paths"]
    assert set(paths["/v1/audio/voices"]) == {"post", "get"} and "delete" in paths["/v1/audio/voices/{name}"]
    form = paths["/generate"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert form["allOf"][1]["properties"]["audio"]["format"] == "binary"
    gen = doc["components"]["schemas"]["GenerateRequest"]["properties"]
    speech = doc["components"]["schemas"]["SpeechRequest"]["properties"]
    assert "ref_text" in gen and {"ref_audio", "ref_text"} <= set(speech)
    assert "Base" in speech["task_type"]["enum"]
    refs = {v for v in _walk(doc) if isinstance(v, str) and v.startswith("#/components/schemas/")}
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(doc["components"]["schemas"])


def _walk(x: Any):
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)
    else:
        yield x
