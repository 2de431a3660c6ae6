"""The gateway over real HTTP and real ZMQ, with the test playing every other process.

`FakeWorkers` binds/connects the other ends of the gateway's sockets through `common.ipc`
channels and speaks the real message types: it pulls `GenerateRequest`s as a tokenizer worker
would, pushes `AudioChunks` / `RequestError` / `ProcStatus` as the codec and tokenizer workers
would, and joins the gateway's gpu pool as a gpu_worker to take what it sends there (`Abort`).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import soundfile as sf
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from common.config import GatewaySettings, ServeConfig, TokenizerSettings
from common.ipc import Addresses, AsyncPushChannel
from common.messages import (
    Abort,
    AudioChunk,
    AudioChunks,
    Finished,
    FinishReason,
    GatewayInMsg,
    GenerateRequest,
    GpuInMsg,
    ProcState,
    ProcStatus,
    RequestError,
)
from common.pool import AsyncWorkChannel
from gateway.body import MAX_BODY_BYTES
from gateway.fields import FormFields
from gateway.server import GATEWAY, build_app
from gateway.validation import BadRequest, parse_generate
from gateway.wav import wav_header
from tests.specs import model_spec

REPO = Path(__file__).resolve().parents[1]
SAMPLE_RATE = 24000
MAX_TEXT = 100


class FakeWorkers:
    """The tokenizer pool, gpu_worker and codec_worker, reduced to their sockets."""

    def __init__(self, addrs: Addresses, tokenizer: bool = True) -> None:
        self.recv_requests = AsyncWorkChannel[GenerateRequest](addrs.requests, GenerateRequest, name="fake")
        if not tokenizer:  # no tokenizer worker in the pool
            self.recv_requests.close()
        # A gpu_worker of the gateway's gpu pool (it takes Prompts and broadcast Aborts).
        self.recv_gpu_in = AsyncWorkChannel[GpuInMsg](addrs.gpu_in, GpuInMsg, name="fake-gpu")
        self.send_to_gateway = AsyncPushChannel[GatewayInMsg](addrs.gateway_in, bind=False)

    async def join_gpu_pool(self, app: web.Application) -> None:
        """Announce the fake gpu_worker until the gateway knows it (so broadcast Aborts reach it)."""
        deadline = time.monotonic() + 5
        while not app[GATEWAY]._send_to_gpu.workers:
            assert time.monotonic() < deadline, "the gateway never heard from the fake gpu_worker"
            self.recv_gpu_in._send(self.recv_gpu_in._ready())
            await asyncio.sleep(0.02)

    async def announce(self, app: web.Application, model: str) -> None:
        """Announce the served model's spec as a tokenizer worker does, until the gateway has it."""
        deadline = time.monotonic() + 5
        while app[GATEWAY].spec is None:
            assert time.monotonic() < deadline, "the gateway never took the model's spec"
            await self.send(model_spec(model))
            await asyncio.sleep(0.02)

    async def next_request(self) -> GenerateRequest:
        return await asyncio.wait_for(self.recv_requests.recv(), 5)

    async def next_gpu_msg(self, timeout: float = 5) -> GpuInMsg:
        """The next message for the gpu_worker, past the gateway's greeting (Abort everything)."""
        while True:
            msg = await asyncio.wait_for(self.recv_gpu_in.recv(), timeout)
            if not (isinstance(msg, Abort) and msg.everything):
                return msg

    async def send(self, msg: GatewayInMsg) -> None:
        await self.send_to_gateway.send(msg)

    async def audio(self, rid: str, *pcms: bytes, finish: FinishReason | None = None, **fin: Any) -> None:
        """One codec batch: chunks for `rid`, then (optionally) its Finished."""
        chunks = [AudioChunk(rid=rid, index=i, pcm=p) for i, p in enumerate(pcms)]
        finished = [] if finish is None else [Finished(rid=rid, reason=finish, **fin)]
        await self.send(AudioChunks(chunks=chunks, finished=finished))

    async def status(self, name: str, role: str, state: ProcState = ProcState.READY) -> None:
        await self.send(ProcStatus(name=name, role=role, pid=4242, state=state, time=time.time()))

    def close(self) -> None:
        for chan in (self.recv_requests, self.recv_gpu_in, self.send_to_gateway):
            chan.close()


class Rig:
    def __init__(self, client: TestClient, workers: FakeWorkers, cfg: ServeConfig) -> None:
        self.client, self.workers, self.cfg = client, workers, cfg

    def post(self, **kwargs: Any) -> asyncio.Task[aiohttp.ClientResponse]:
        """Start a POST /generate; it completes once the gateway has its first event."""
        return asyncio.create_task(self.client.post("/generate", **kwargs))


def _cfg(addrs: Addresses, **overrides: Any) -> ServeConfig:
    return ServeConfig(
        model="orpheus-tiny",
        tokenizer=TokenizerSettings(workers=2),
        gateway=GatewaySettings(max_text_chars=MAX_TEXT),
        addresses=addrs,
        **overrides,
    )


@pytest.fixture
def make_addrs() -> Iterator[Callable[[], Addresses]]:
    """Fresh ipc addresses in a short private dir (unix socket paths must stay under ~107 bytes;
    pytest's tmp_path can be longer)."""
    dirs: list[str] = []

    def make() -> Addresses:
        dirs.append(tempfile.mkdtemp(prefix="vpgw-"))
        return Addresses.local(dirs[-1])

    yield make
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def start_rig(make_addrs: Callable[[], Addresses]) -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    """Factory: a gateway app on a test server plus fake workers on fresh ipc sockets."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def start(tokenizer: bool = True, **app_kwargs: Any) -> Rig:
        addrs = make_addrs()
        workers = FakeWorkers(addrs, tokenizer=tokenizer)
        cfg = _cfg(addrs)
        client = TestClient(TestServer(build_app(cfg, **app_kwargs)))
        await client.start_server()
        await workers.join_gpu_pool(client.app)
        await workers.announce(client.app, cfg.model)

        async def cleanup() -> None:
            await client.close()
            workers.close()

        cleanups.append(cleanup)
        return Rig(client, workers, cfg)

    yield start
    for cleanup in cleanups:
        await cleanup()


@pytest.fixture
async def rig(start_rig: Callable[..., Awaitable[Rig]]) -> Rig:
    return await start_rig()


def _pcm(n: int, start: int = 0) -> bytes:
    return (np.arange(start, start + n) % 2000 - 1000).astype("<i2").tobytes()


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# -- audio -------------------------------------------------------------------------------------------


async def test_streaming_response_is_an_open_ended_wav_with_pcm_in_order(rig: Rig) -> None:
    task = rig.post(json={"text": "Hello there"})
    req = await rig.workers.next_request()
    parts = [_pcm(512, 0), b"", _pcm(300, 512)]  # the empty one is a window the codec dropped
    await rig.workers.audio(req.rid, *parts)
    resp = await task
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "audio/wav"
    assert resp.headers["X-Request-Id"] == req.rid
    assert resp.headers.get("Transfer-Encoding") == "chunked"
    head = await resp.content.readexactly(44)
    assert head == wav_header(SAMPLE_RATE, None)
    assert head[4:8] == b"\xff\xff\xff\xff" and head[40:44] == b"\xff\xff\xff\xff"
    await rig.workers.audio(req.rid, _pcm(100, 812), finish=FinishReason.STOP)
    assert await resp.read() == _pcm(912)


async def test_request_carries_validated_fields_and_model_defaults(rig: Rig) -> None:
    task = rig.post(json={"text": "Hi", "voice": "leo", "top_k": 50, "seed": 2**63 - 1, "max_tokens": 300})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, finish=FinishReason.LENGTH)
    resp = await task
    assert resp.status == 200 and await resp.read() == wav_header(SAMPLE_RATE, None)
    s = req.sampling
    assert (req.text, req.model_kwargs) == ("Hi", {"voice": "leo"})
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.6, 0.8, 1.3)  # orpheus defaults
    assert (s.top_k, s.seed, s.max_tokens, s.min_tokens, s.constrained) == (50, 2**63 - 1, 300, 0, True)
    assert abs(req.arrival - time.time()) < 5


async def test_non_streaming_response_is_a_complete_wav_that_soundfile_reads(rig: Rig) -> None:
    task = rig.post(data={"text": "Hello", "streaming": "no", "temperature": "0"})
    req = await rig.workers.next_request()
    assert req.sampling.temperature == 0.0 and req.model_kwargs == {"voice": "tara"}
    await rig.workers.audio(req.rid, _pcm(2048), _pcm(1000, 2048))
    await rig.workers.audio(req.rid, _pcm(48, 3048), finish=FinishReason.STOP)
    resp = await task
    body = await resp.read()
    assert resp.status == 200 and resp.headers["Content-Length"] == str(len(body)) == str(44 + 2 * 3096)
    audio, sr = sf.read(io.BytesIO(body), dtype="int16")
    assert sr == SAMPLE_RATE and audio.shape == (3096,)
    assert audio.tobytes() == _pcm(3096)


# -- bad input ---------------------------------------------------------------------------------------


class _chunked:
    """A body sent with Transfer-Encoding: chunked (no Content-Length to refuse it up front)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"<chunked {len(self.data)} bytes>"

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), 1 << 16):
            yield self.data[i : i + (1 << 16)]


def _upload() -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("text", b"hi", filename="speech.txt")
    return form


_FORM = "application/x-www-form-urlencoded"
_BAD_INPUTS: list[tuple[dict[str, Any], int, str]] = [
    ({"json": {}}, 400, "'text' is required"),
    ({"json": {"text": ""}}, 400, "'text' is empty"),
    ({"json": {"text": "  \n\t"}}, 400, "'text' is empty"),
    ({"json": {"text": 12}}, 400, "'text' must be a string"),
    ({"json": {"text": "a" * (MAX_TEXT + 1)}}, 400, f"the limit is {MAX_TEXT}"),
    ({"json": {"text": "hi", "voice": "bob"}}, 400, "voices are: tara, leah"),
    ({"json": {"text": "hi", "temperature": "abc"}}, 400, "'temperature' must be a number in [0, 2]"),
    ({"json": {"text": "hi", "temperature": True}}, 400, "'temperature' must be a number"),
    ({"json": {"text": "hi", "temperature": 2.5}}, 400, "in [0, 2], got 2.5"),
    (
        {"data": '{"text": "hi", "temperature": NaN}', "headers": {"Content-Type": "application/json"}},
        400,
        "finite",
    ),
    ({"data": {"text": "hi", "top_p": "inf"}}, 400, "finite"),
    ({"json": {"text": "hi", "top_p": "0.5"}}, 400, "without quotes"),
    ({"json": {"text": "hi", "top_p": None}}, 400, "leave the field out"),
    ({"json": {"text": "hi", "top_p": 0}}, 400, "'top_p' must be a number in (0, 1]"),
    ({"json": {"text": "hi", "top_p": 1.5}}, 400, "(0, 1]"),
    ({"json": {"text": "hi", "top_k": -1}}, 400, "'top_k' must be an integer in [0, "),
    ({"json": {"text": "hi", "top_k": 2.5}}, 400, "'top_k' must be an integer"),
    ({"json": {"text": "hi", "min_p": 1.5}}, 400, "'min_p' must be a number in [0, 1]"),
    ({"json": {"text": "hi", "repetition_penalty": 0}}, 400, "(0, 10]"),
    ({"json": {"text": "hi", "repetition_penalty": 11}}, 400, "(0, 10]"),
    ({"json": {"text": "hi", "seed": -1}}, 400, "'seed' must be an integer in [0, 9223372036854775807]"),
    ({"json": {"text": "hi", "seed": 2**63}}, 400, "'seed' must be an integer"),
    ({"json": {"text": "hi", "max_tokens": 0}}, 400, "'max_tokens' must be an integer in [1, 400]"),
    ({"json": {"text": "hi", "max_tokens": 401}}, 400, "[1, 400]"),
    (
        {"json": {"text": "hi", "max_tokens": 100, "min_tokens": 101}},
        400,
        "'min_tokens' must be an integer in [0, 100]",
    ),
    ({"json": {"text": "hi", "streaming": "abc"}}, 400, "'streaming' must be a boolean"),
    ({"json": {"text": "hi", "streaming": 2}}, 400, "'streaming' must be a boolean"),
    ({"json": {"text": "hi", "speed": 2}}, 400, "unknown field 'speed'; accepted fields: text, voice"),
    ({"data": {"text": "hi", "top_k": "many"}}, 400, "'top_k' must be an integer"),
    (
        {"data": '{"text": "hi"}', "headers": {"Content-Type": "application/x-www-form-urlencoded"}},
        400,
        "Content-Type: application/json",
    ),
    ({"json": ["hi"]}, 400, "must be a JSON object"),
    ({"data": '{"text": "hi"', "headers": {"Content-Type": "application/json"}}, 400, "not valid JSON"),
    (
        {"data": b'{"text": "\xff\xfe"}', "headers": {"Content-Type": "application/json"}},
        400,
        "not valid UTF-8",
    ),
    ({"data": b"", "headers": {"Content-Type": "application/json"}}, 400, "body is empty"),
    ({"data": _upload()}, 400, "form field 'text' must be a plain value, not a file upload"),
    (
        {"data": "text=hi&text=again", "headers": {"Content-Type": _FORM}},
        400,
        "form field 'text' is given more than once",
    ),
    ({"data": b"text=\xff", "headers": {"Content-Type": _FORM}}, 400, "not valid UTF-8"),
    (
        {"data": "text=hi", "headers": {"Content-Type": "text/plain"}},
        415,
        "unsupported Content-Type 'text/plain'",
    ),
    (
        {"data": io.BytesIO(b"x" * (MAX_BODY_BYTES + 1)), "headers": {"Content-Type": "application/json"}},
        413,
        "larger than",
    ),
    (
        {"data": _chunked(b"x" * (MAX_BODY_BYTES + 1)), "headers": {"Content-Type": "application/json"}},
        413,
        "larger than",
    ),
]


async def test_every_bad_input_gets_a_4xx_that_says_what_to_change_and_the_server_keeps_serving(
    rig: Rig,
) -> None:
    for kwargs, status, needle in _BAD_INPUTS:
        resp = await rig.client.post("/generate", **kwargs)
        body = await resp.json()
        case = f"{kwargs} → {resp.status} {body}"
        assert resp.status == status, case
        assert needle in body["error"], case
        assert len(resp.headers["X-Request-Id"]) == 32, case
    for method, path, status in [("GET", "/generate", 405), ("GET", "/nope", 404)]:
        resp = await rig.client.request(method, path)
        assert resp.status == status and "error" in await resp.json()
    # Still serving: a good request goes through.
    task = rig.post(json={"text": "still here", "streaming": False})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(10), finish=FinishReason.STOP)
    assert (await task).status == 200


def test_validation_reads_form_strings_and_rejects_what_json_would() -> None:
    spec, cfg = (
        model_spec("orpheus-tiny"),
        ServeConfig(model="orpheus-tiny", gateway=GatewaySettings(constrained=False)),
    )
    form = FormFields(
        {
            "text": "hi",
            "streaming": "False",
            "top_k": "7",
            "min_p": "0.05",
            "seed": "12",
            "min_tokens": "3",
        }
    )
    p = parse_generate(form, spec, cfg)
    assert not p.streaming and p.voice == "tara"
    assert (p.sampling.top_k, p.sampling.min_p, p.sampling.seed, p.sampling.min_tokens) == (7, 0.05, 12, 3)
    assert p.sampling.constrained is False  # cfg overrides the spec's default
    assert (
        p.sampling.max_tokens == 400 and 0 <= parse_generate({"text": "x"}, spec, cfg).sampling.seed < 2**63
    )
    with pytest.raises(BadRequest, match="'streaming' must be a boolean"):
        parse_generate({"text": "hi", "streaming": [1]}, spec, cfg)
    with pytest.raises(BadRequest, match="'streaming' must be a boolean"):
        parse_generate(dict(form), spec, cfg)  # the same strings in a JSON body


# -- errors from the workers -------------------------------------------------------------------------


async def test_request_error_before_audio_is_answered_with_its_status(rig: Rig) -> None:
    task = rig.post(json={"text": "too long a prompt"})
    req = await rig.workers.next_request()
    await rig.workers.send(
        RequestError(rid=req.rid, status=400, message="prompt is 500 tokens; max_tokens is 400")
    )
    resp = await task
    assert resp.status == 400 and resp.headers["X-Request-Id"] == req.rid
    assert (await resp.json())["error"] == "prompt is 500 tokens; max_tokens is 400"

    task = rig.post(json={"text": "boom"})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, finish=FinishReason.ERROR, message="CUDA error")  # status 0 → 500
    resp = await task
    assert resp.status == 500 and (await resp.json())["error"] == "CUDA error"


async def test_error_after_audio_began_breaks_the_stream(rig: Rig) -> None:
    task = rig.post(json={"text": "hi"})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(256))
    resp = await task
    assert resp.status == 200
    assert await resp.content.readexactly(44 + 512) == wav_header(SAMPLE_RATE, None) + _pcm(256)
    await rig.workers.audio(req.rid, finish=FinishReason.ERROR, status=500, message="codec died")
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()


async def test_error_after_audio_in_non_streaming_mode_is_a_json_error(rig: Rig) -> None:
    task = rig.post(json={"text": "hi", "streaming": False})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(256))
    await rig.workers.audio(req.rid, finish=FinishReason.ERROR, status=503, message="gpu_worker restarted")
    resp = await task
    assert resp.status == 503 and (await resp.json())["error"] == "gpu_worker restarted"


async def test_messages_for_unknown_requests_are_ignored(rig: Rig) -> None:
    await rig.workers.audio("gone", _pcm(10), finish=FinishReason.STOP)
    await rig.workers.send(RequestError(rid="gone", status=400, message="late"))
    task = rig.post(data=aiohttp.FormData({"text": "hi", "streaming": "0"}, default_to_multipart=True))
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(10), finish=FinishReason.STOP)
    resp = await task
    assert resp.status == 200 and await resp.read() == wav_header(SAMPLE_RATE, 10) + _pcm(10)


# -- cancellation ------------------------------------------------------------------------------------


async def test_client_disconnect_before_audio_sends_abort(rig: Rig) -> None:
    task = rig.post(json={"text": "hi"})
    req = await rig.workers.next_request()
    task.cancel()  # the client gives up while the gateway waits for the first chunk
    assert await rig.workers.next_gpu_msg() == Abort(rids=[req.rid])


async def test_client_disconnect_during_stream_sends_abort(rig: Rig) -> None:
    task = rig.post(json={"text": "hi"})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(256))
    resp = await task
    await resp.content.readexactly(44)
    resp.close()
    assert await rig.workers.next_gpu_msg() == Abort(rids=[req.rid])
    await rig.workers.audio(req.rid, _pcm(256), finish=FinishReason.ABORT)  # late news: ignored
    assert (await rig.client.get("/health")).status == 200


async def test_client_disconnect_is_noticed_without_handler_cancellation(
    make_addrs: Callable[[], Addresses],
) -> None:
    # Another runner may leave aiohttp's handler cancellation off; the gateway polls its transport.
    addrs, port = make_addrs(), _free_port()
    runner = web.AppRunner(build_app(_cfg(addrs)))  # handler_cancellation defaults to False
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    workers = FakeWorkers(addrs)
    await workers.join_gpu_pool(runner.app)
    await workers.announce(runner.app, "orpheus-tiny")
    try:
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(f"http://127.0.0.1:{port}/generate", json={"text": "hi"}))
            req = await workers.next_request()
            task.cancel()
            assert await workers.next_gpu_msg(timeout=3) == Abort(rids=[req.rid])
    finally:
        await runner.cleanup()
        workers.close()


async def test_no_tokenizer_worker_gives_503_instead_of_hanging(
    start_rig: Callable[..., Awaitable[Rig]],
) -> None:
    rig = await start_rig(tokenizer=False, submit_timeout_s=0.3)
    resp = await rig.client.post("/generate", json={"text": "hi"})
    assert resp.status == 503 and "no tokenizer worker took the request" in (await resp.json())["error"]


async def test_shutdown_fails_requests_in_flight_and_aborts_them(rig: Rig) -> None:
    tasks = [rig.post(json={"text": "hi"}), rig.post(json={"text": "ho", "streaming": False})]
    rids = {(await rig.workers.next_request()).rid for _ in tasks}
    await rig.client.app.shutdown()  # what the runner does first on SIGTERM
    for task in tasks:
        resp = await task
        assert resp.status == 503 and "shutting down" in (await resp.json())["error"]
    abort = await rig.workers.next_gpu_msg()
    assert isinstance(abort, Abort) and set(abort.rids) == rids


async def test_idle_request_times_out_with_504_and_abort(start_rig: Callable[..., Awaitable[Rig]]) -> None:
    rig = await start_rig(idle_timeout_s=0.3)
    task = rig.post(json={"text": "hi", "streaming": False})
    req = await rig.workers.next_request()
    resp = await task
    assert resp.status == 504 and "no progress from the workers" in (await resp.json())["error"]
    assert await rig.workers.next_gpu_msg() == Abort(rids=[req.rid])

    # Stalled mid-stream: the transfer breaks (a clean end would pass for a complete file).
    task = rig.post(json={"text": "hi"})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, _pcm(64))
    resp = await task
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    assert await rig.workers.next_gpu_msg() == Abort(rids=[req.rid])


# -- health and readiness ----------------------------------------------------------------------------


async def test_health_is_ok_while_running(rig: Rig) -> None:
    resp = await rig.client.get("/health")
    assert resp.status == 200 and await resp.json() == {"status": "ok"}


async def test_ready_only_while_every_process_reports_ready(rig: Rig) -> None:
    async def ready() -> tuple[int, dict[str, Any]]:
        resp = await rig.client.get("/ready")
        return resp.status, await resp.json()

    status, body = await ready()
    assert status == 503 and body["ready"] is False and body["model"] == "orpheus-tiny"
    states = {p["name"]: p["state"] for p in body["processes"]}
    assert states == {
        "gateway": "ready",
        "gpu_worker": "missing",
        "codec_worker": "missing",
        "tokenizer_worker.0": "missing",
        "tokenizer_worker.1": "missing",
    }
    assert body["processes"][0] == {
        "name": "gateway",
        "role": "gateway",
        "pid": os.getpid(),
        "state": "ready",
        "detail": "",
        "age_s": 0.0,
    }

    procs = [
        ("gpu_worker", "gpu_worker"),
        ("codec_worker", "codec_worker"),
        ("tokenizer_worker.0", "tokenizer_worker"),
    ]
    for name, role in procs:
        await rig.workers.status(name, role)
    await rig.workers.status("tokenizer_worker.1", "tokenizer_worker", ProcState.LOADING)

    async def shows(name: str, state: str) -> bool:
        _, body = await ready()
        return any(p["name"] == name and p["state"] == state for p in body["processes"])

    await _eventually(lambda: shows("tokenizer_worker.1", "loading"))
    assert (await ready())[0] == 503

    await rig.workers.status("tokenizer_worker.1", "tokenizer_worker")
    for name, role in procs:  # a heartbeat
        await rig.workers.status(name, role)
    await _eventually(lambda: shows("tokenizer_worker.1", "ready"))
    status, body = await ready()
    assert status == 200 and body["ready"] is True
    assert all(p["state"] == "ready" and p["age_s"] < 1.0 for p in body["processes"])

    # Heartbeats stop: after 1 s every worker is unresponsive and the gateway is not ready.
    await _eventually(lambda: shows("gpu_worker", "unresponsive"))
    status, body = await ready()
    assert status == 503 and {p["state"] for p in body["processes"][1:]} == {"unresponsive"}


# -- the process -------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _raw_http(port: int, data: bytes) -> bytes:
    """Send raw bytes, read the reply until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_python_m_gateway_serves_until_sigterm_and_fails_loudly_on_bad_config(
    make_addrs: Callable[[], Addresses],
) -> None:
    port = _free_port()
    addrs = make_addrs()
    cfg = ServeConfig(
        model="orpheus-tiny", gateway=GatewaySettings(port=port), addresses=addrs, log_level="WARNING"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--config-json", cfg.to_json(), "--name", "gateway"],
        cwd=REPO,
        env=env,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                reply = _raw_http(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "gateway did not come up"
                time.sleep(0.05)
        assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(json.dumps({"status": "ok"}).encode())
        assert b" 400 Bad Request" in _raw_http(port, b"NOT HTTP AT ALL\r\n\r\n").split(b"\r\n")[0]
        assert _raw_http(port, b"GET /health HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")  # still up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

    empty_key = Path(addrs.requests.removeprefix("ipc://")).parent / "empty-key"
    empty_key.write_text("\n")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "--config-json",
            msgspec.structs.replace(cfg, gateway=GatewaySettings(api_key_file=str(empty_key))).to_json(),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
    )
    # The gateway knows no model registry (the model's facts reach it from the tokenizer workers):
    # what it refuses at startup are its own settings.
    assert bad.returncode == 1 and "--api-key-file" in bad.stderr


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.__main__, gateway.server; "
        "assert not {'torch', 'programs'} & set(sys.modules), 'torch or programs imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=20)
