"""Input streaming over the WebSocket (`GET /v1/audio/speech/stream`), through every process on
orpheus-tiny: audio starts before the input ends, the session's audio is its segments generated
alone (seed + k) and joined, `clear` stops the audio and frees every page, and a client that
vanishes leaks nothing."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from gateway.segments import FADE_S, Joiner
from tests.test_end_to_end_http import pcm_of, same_audio

PATH = "/v1/audio/speech/stream"
SHORT = {"max_tokens": 70, "min_tokens": 40}  # a few codec windows per segment: fast on a CPU
LONG = {"max_tokens": 400, "min_tokens": 380}  # the longest generations orpheus-tiny takes
# 20 segments of LONG generations: seconds of generating on a CPU, time to interrupt it
SENTENCES = "".join(f"Sentence number {k:02d} is here. " for k in range(20))


def _open(seed: int, **fields) -> dict:
    return {"type": "session", "model": "orpheus-tiny", "voice": "tara", "seed": seed, **fields}


async def _next_event(ws: aiohttp.ClientWebSocketResponse, audio: list[bytes], timeout: float = 60) -> dict:
    """The next JSON event; binary frames met on the way are appended to `audio`."""
    while True:
        msg = await ws.receive(timeout=timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio.append(msg.data)
            continue
        assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
        return json.loads(msg.data)


async def _first_audio(ws: aiohttp.ClientWebSocketResponse, audio: list[bytes], events: list[dict]) -> None:
    """Read until the first binary frame (at once: not on to the next event)."""
    while not audio:
        msg = await ws.receive(timeout=60)
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio.append(msg.data)
        else:
            assert msg.type == aiohttp.WSMsgType.TEXT, (msg.type, msg.data, msg.extra)
            events.append(json.loads(msg.data))
            assert events[-1]["type"] != "error", events[-1]


async def _until(ws, audio: list[bytes], kind: str, seen: list[dict] | None = None) -> dict:
    while True:
        event = await _next_event(ws, audio)
        assert event["type"] != "error", event
        if seen is not None:
            seen.append(event)
        if event["type"] == kind:
            return event


async def _metrics(s: aiohttp.ClientSession, base: str) -> dict[tuple[str, tuple], float]:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def _held(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """What the gateway and the gpu_worker hold now: KV pages, active streams, registered
    generations, WebSocket sessions; once the gpu_worker's heartbeat has reported its metrics."""
    gpu = (("process", "gpu_worker"), ("role", "gpu_worker"))
    deadline = time.monotonic() + 10
    m = await _metrics(s, base)
    while ("voxpipe_kv_pages_used", gpu) not in m and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        m = await _metrics(s, base)
    return {
        "kv_pages_used": m[("voxpipe_kv_pages_used", gpu)],
        "active_streams": m[("voxpipe_active_streams", gpu)],
        "registered": m[("voxpipe_gateway_requests_registered", ())],
        "sessions": m[("voxpipe_http_requests_in_flight", (("endpoint", "websocket"),))],
    }


async def _nothing_held_within(s: aiohttp.ClientSession, base: str, seconds: float) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        held = await _held(s, base)
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.05)


async def test_audio_arrives_before_the_input_ends(server):
    first_audio = ("voxpipe_websocket_text_to_first_audio_seconds_count", ())
    async with aiohttp.ClientSession() as s:
        before = (await _metrics(s, server.base))[first_audio]
        await _speak_two_sentences(s, server.base)
        assert (await _metrics(s, server.base))[first_audio] == before + 1


async def _speak_two_sentences(s: aiohttp.ClientSession, base: str) -> None:
    async with s.ws_connect(base + PATH) as ws:
        await ws.send_json(_open(7, **SHORT))
        started = await _next_event(ws, [])
        assert started["type"] == "session.started" and started["sample_rate"] == 24000
        assert started["mode"] == "segmented" and started["model"] == "orpheus-tiny"
        audio: list[bytes] = []
        events: list[dict] = []
        for piece in ("Hello", " there.", " How are"):
            await ws.send_json({"type": "append", "text": piece})
        acks = [await _until(ws, audio, "ack", events) for _ in range(3)]
        assert [a["seq"] for a in acks] == [1, 2, 3] and acks[-1]["characters"] == len("Hello there. How are")
        await _first_audio(ws, audio, events)  # the first sentence speaks: "How are" waits
        assert [e["type"] for e in events][-1] == "audio.started"
        await ws.send_json({"type": "append", "text": " you"})
        await ws.send_json({"type": "end"})
        done = await _until(ws, audio, "done", events)
        closed = await ws.receive(timeout=10)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000
    segments = [e["text"] for e in events if e["type"] == "segment.done"]
    assert segments == ["Hello there.", "How are you"]
    pcm = b"".join(audio)
    assert done["usage"]["audio_seconds"] == round(len(pcm) / 2 / 24000, 4) > 0
    assert done["usage"]["characters"] == len("Hello there. How are you") and done["usage"]["segments"] == 2


async def test_streamed_audio_equals_its_segments_generated_alone_and_joined(server):
    seed = 1234
    pieces = ["The first sen", "tence is here. Then", " a second", " one! And", " a third"]
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(server.base + PATH) as ws:
            await ws.send_json(_open(seed, **SHORT))
            audio: list[bytes] = []
            await _until(ws, audio, "session.started")
            for piece in pieces:
                await ws.send_json({"type": "append", "text": piece})
                await asyncio.sleep(0.05)  # text arriving while the first segment generates
            await ws.send_json({"type": "end"})
            events: list[dict] = []
            await _until(ws, audio, "done", events)
        texts = [e["text"] for e in events if e["type"] == "segment.done"]
        assert texts == ["The first sentence is here.", "Then a second one!", "And a third"]
        alone = []
        for k, text in enumerate(texts):  # segment k alone, as /generate speaks it with seed + k
            body = {"text": text, "voice": "tara", "seed": seed + k, "streaming": False, **SHORT}
            async with s.post(server.base + "/generate", json=body) as r:
                assert r.status == 200
                alone.append(pcm_of(await r.read()))
    joiner = Joiner(round(FADE_S * 24000))
    joined = b""
    for pcm in alone:  # every segment but the first fades in; every one fades out
        joiner.start(last=False)
        joined += joiner.feed(pcm.tobytes()) + joiner.end()
    streamed = np.frombuffer(b"".join(audio), dtype="<i2")
    assert len(streamed) == sum(len(p) for p in alone) > 0
    assert same_audio(streamed, np.frombuffer(joined, dtype="<i2"))
    assert not same_audio(streamed, np.concatenate(alone)), "the joins are faded"


async def test_clear_stops_the_audio_and_frees_every_page_within_a_second(server):
    async with aiohttp.ClientSession() as s, s.ws_connect(server.base + PATH) as ws:
        await ws.send_json(_open(3, **LONG))
        audio: list[bytes] = []
        await _until(ws, audio, "session.started")
        await ws.send_json({"type": "append", "text": SENTENCES})
        await _first_audio(ws, audio, [])
        await ws.send_json({"type": "append", "text": "Text still buffered"})
        await ws.send_json({"type": "clear"})
        cleared = await _until(ws, audio, "cleared")
        cleared_at = time.monotonic()
        assert 18 <= cleared["segments"] <= 20  # a segment plays for seconds: the clear cut the first ones
        held = await _nothing_held_within(s, server.base, 1.0)
        assert time.monotonic() - cleared_at < 1.0 + 0.3, held
        assert held == {"kv_pages_used": 0, "active_streams": 0, "registered": 0, "sessions": 1}
        await ws.send_json({"type": "flush"})  # nothing buffered: the clear dropped it
        await ws.send_json({"type": "append", "text": "A new reply."})
        await ws.send_json({"type": "end"})
        after: list[bytes] = []
        seen: list[dict] = []
        await _until(ws, after, "audio.started", seen)
        assert not after, "no audio of the cleared segments after cleared"
        await _until(ws, after, "done", seen)
    assert [e["index"] for e in seen if e["type"] == "segment.done"] == [20]  # ids and seeds go on
    assert after, "the session speaks again after a clear"


async def test_a_client_that_vanishes_mid_audio_leaks_nothing(server):
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(server.base + PATH)
        await ws.send_json(_open(11, **LONG))
        audio: list[bytes] = []
        await _until(ws, audio, "session.started")
        await ws.send_json({"type": "append", "text": SENTENCES})
        await _first_audio(ws, audio, [])
        assert (await _held(s, server.base))["kv_pages_used"] > 0
        ws._conn.transport.abort()  # gone without a close frame
        held = await _nothing_held_within(s, server.base, 3.0)
        assert held == {"kv_pages_used": 0, "active_streams": 0, "registered": 0, "sessions": 0}
        m = await _metrics(s, server.base)
        assert m[("voxpipe_admitted_streams", ())] == 0
