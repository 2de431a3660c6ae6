"""Through every process (`voxpipe serve` on orpheus-tiny): cancellation frees the gpu_worker's KV
pages and slot, long text is its segments joined without clicks, and the OpenAI endpoint's events
carry decodable audio. The gpu_worker's state is read where an operator reads it: GET /metrics."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import urllib.request

import aiohttp
import numpy as np
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from gateway.segments import FADE_S, split_text

CHUNK = 2048
FADE = round(FADE_S * 24000)
THREE_SENTENCES = "The first sentence is here. The second one follows it. And a third ends it."
LONG_TEXT = " ".join(
    f"This is sentence number {i} of a long text that takes a while to speak." for i in range(12)
)


def metrics(base: str) -> dict[str, float]:
    """The gpu_worker's gauges and counters, and the request counters, as {name or name{labels}: value}."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("role") == "gpu_worker":
                out[s.name] = s.value
            elif s.name == "voxpipe_requests_total":
                out[f"{s.name}{{{s.labels['endpoint']},{s.labels['outcome']}}}"] = s.value
    return out


def wait_for(base: str, check, timeout: float) -> tuple[dict[str, float], float]:
    """Poll /metrics until `check(metrics)`; (the metrics, seconds it took)."""
    start = time.monotonic()
    while True:
        m = metrics(base)
        if "voxpipe_kv_pages_used" in m and check(m):
            return m, time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not reached in {timeout} s: {m}"
        time.sleep(0.02)


def idle(m: dict[str, float]) -> bool:
    return (
        m["voxpipe_kv_pages_used"] == 0 and m["voxpipe_active_streams"] == 0 and m["voxpipe_queue_depth"] == 0
    )


async def test_client_disconnect_frees_kv_pages_and_slot_and_stops_generation(server) -> None:
    before, _ = wait_for(server.base, idle, 10)
    assert before["voxpipe_kv_pages_total"] > 0
    body = {"model": "orpheus-tiny", "input": LONG_TEXT, "response_format": "pcm", "seed": 3}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/v1/audio/speech", json=body) as r:
            assert r.status == 200
            await r.content.readexactly(2 * CHUNK * 2)  # two chunks: it is generating

            def streaming(m: dict[str, float]) -> bool:
                return m["voxpipe_kv_pages_used"] > 0 and m["voxpipe_active_streams"] == 1

            busy, _ = await asyncio.to_thread(wait_for, server.base, streaming, 5)
            # leaving the block without reading the rest closes the connection: the client is gone
    after, freed_in = await asyncio.to_thread(wait_for, server.base, idle, 5)
    # The first segment alone would run to ~350 tokens and the text has 12 segments: generation
    # stopped a few steps after the disconnect (the heartbeat read before it is up to 0.25 s old,
    # and the gpu_worker drains the Abort at the top of its next step).
    late = after["voxpipe_generated_tokens_total"] - busy["voxpipe_generated_tokens_total"]
    assert late < 60, late
    await asyncio.sleep(0.5)
    assert metrics(server.base)["voxpipe_generated_tokens_total"] == after["voxpipe_generated_tokens_total"]
    key = "voxpipe_requests_total{speech,cancelled}"
    assert after[key] == before.get(key, 0) + 1
    assert freed_in < 3.0


async def _read_pcm(session: aiohttp.ClientSession, url: str, body: dict) -> np.ndarray:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.read()
    return np.frombuffer(data[44:] if url.endswith("/generate") else data, dtype="<i2").astype(np.int32)


async def test_long_text_is_its_segments_in_order_joined_without_clicks(server) -> None:
    segments = split_text(THREE_SENTENCES, 42)
    assert len(segments) == 3
    async with aiohttp.ClientSession() as s:
        body = {"model": "orpheus-tiny", "input": THREE_SENTENCES, "response_format": "pcm", "seed": 11}
        whole = await _read_pcm(s, server.base + "/v1/audio/speech", {**body, "max_tokens": 96})
        # Each segment alone, with the seed the gateway gives it (seed + k): the same audio.
        alone = await asyncio.gather(
            *(
                _read_pcm(
                    s,
                    server.base + "/generate",
                    {"text": text, "seed": 11 + k, "max_tokens": 96, "streaming": False},
                )
                for k, text in enumerate(segments)
            )
        )
    assert all(len(a) > 0 and len(a) % CHUNK == 0 for a in alone)
    assert len(whole) == sum(len(a) for a in alone)  # nothing added or dropped at the joins
    offset = 0
    for k, a in enumerate(alone):
        inner = slice(FADE if k else 0, len(a) - FADE if k < len(alone) - 1 else len(a))
        # Equal up to one PCM16 step (the codec batches requests differently; see test_end_to_end_http).
        assert int(np.abs(whole[offset:][inner] - a[inner]).max()) <= 1
        if k:
            join = whole[offset - 3 : offset + 3]
            assert int(np.abs(np.diff(join)).max()) <= 64, join  # faded to silence on both sides
        offset += len(a)


async def test_openai_sse_events_carry_mp3_that_decodes(server) -> None:
    body = {"model": "tts-1", "input": "Hello there.", "stream_format": "sse", "seed": 4, "max_tokens": 70}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/v1/audio/speech", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
            events = [json.loads(line[6:]) async for line in r.content if line.startswith(b"data: ")]
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 28
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    audio, rate = sf.read(io.BytesIO(mp3), dtype="int16")
    assert rate == 24000 and len(audio) >= CHUNK
