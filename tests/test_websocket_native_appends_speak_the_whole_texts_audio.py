"""Native input streaming over the WebSocket on qwen3-tts-tiny (a model that takes text appended to
a running generation), through every process with a real WebSocket client: the session runs one
generation in the streaming text mode, whose audio equals that of the same text sent whole to
/v1/audio/speech with the same seed (greedy and sampled) however the text was cut; audio starts
before the input ends; while the text runs out the generation takes no steps and resumes when text
comes; a text past one generation's capacity, a clear, and a client that vanishes end cleanly and
leave nothing held."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import aiohttp
import msgspec
import pytest
import zmq

from bench.load_cli import server_model
from bench.websocket import _args, run_level
from common.messages import AppendText, TapHeader, TextPiece
from common.tap import find_taps
from tests.conftest import Server
from tests.test_websocket_input_streaming import _held, _metrics, _next_event, _nothing_held_within, _until

PATH = "/v1/audio/speech/stream"
TEXT = "Hello there, how are you today? I think we should call them first, and then decide."
FRAMES = dict(max_tokens=90, min_tokens=60)  # frames outlast the text: the end of input matters
GPU = (("process", "gpu_worker"), ("role", "gpu_worker"))


@pytest.fixture(scope="module")
def qwen_server():
    srv = Server("--model", "qwen3-tts-tiny", "--tokenizer-workers", "1", "--max-text-chars", "10000")
    yield srv
    srv.stop()


def _open(seed: int, **fields) -> dict:
    return {"type": "session", "model": "qwen3-tts-tiny", "voice": "ryan", "seed": seed, **FRAMES, **fields}


async def _whole(s: aiohttp.ClientSession, base: str, seed: int, **fields) -> bytes:
    body = dict(model="qwen3-tts-tiny", input=TEXT, voice="ryan", seed=seed, response_format="pcm")
    body |= dict(non_streaming_mode=False, **FRAMES, **fields)
    async with s.post(base + "/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def _started(ws: aiohttp.ClientWebSocketResponse, seed: int, **fields) -> None:
    await ws.send_json(_open(seed, **fields))
    started = await _next_event(ws, [])
    assert started["type"] == "session.started" and started["mode"] == "native", started


async def _first_audio(ws: aiohttp.ClientWebSocketResponse, audio: list[bytes], timeout: float = 60) -> None:
    while not audio:
        msg = await ws.receive(timeout=timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio.append(msg.data)
        else:
            event = json.loads(msg.data)
            assert event["type"] in ("ack", "audio.started"), event


async def _steps(s: aiohttp.ClientSession, base: str) -> float:
    return (await _metrics(s, base))[("voxpipe_steps_total", GPU)]


WORDS = TEXT.replace(" ", "\x00 ").split("\x00")  # word by word, each with its leading space
CHUNKS = [TEXT[i : i + 5] for i in range(0, len(TEXT), 5)]  # cut inside words: LLM-style pieces


@pytest.mark.parametrize(
    ("sampling", "pieces"), [(dict(temperature=0.0), WORDS), (dict(temperature=0.9, top_k=50), CHUNKS)]
)
async def test_appended_text_speaks_the_audio_of_the_whole_text(qwen_server, sampling, pieces):
    seed = 21
    async with aiohttp.ClientSession() as s:
        whole = await _whole(s, qwen_server.base, seed, **sampling)
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, seed, **sampling)
            audio: list[bytes] = []
            for piece in pieces:
                await ws.send_json({"type": "append", "text": piece})
                await asyncio.sleep(0.01)
            await ws.send_json({"type": "end"})
            events: list[dict] = []
            done = await _until(ws, audio, "done", events)
            closed = await ws.receive(timeout=10)
    assert closed.type == aiohttp.WSMsgType.CLOSE and closed.data == 1000
    assert b"".join(audio) == whole and len(whole) > 0
    assert [e["text"] for e in events if e["type"] == "segment.done"] == [TEXT]
    assert done["usage"]["segments"] == 1 and done["usage"]["characters"] == len(TEXT)


async def test_audio_starts_before_the_input_ends_and_waiting_takes_no_steps(qwen_server):
    seed = 5
    cut = TEXT.index("I think")
    async with aiohttp.ClientSession() as s:
        whole = await _whole(s, qwen_server.base, seed, temperature=0.0)
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, seed, temperature=0.0)
            audio: list[bytes] = []
            await ws.send_json({"type": "append", "text": TEXT[:cut]})
            await _first_audio(ws, audio)  # the input is still open
            # Its text runs out: it waits with its slot and pages, out of every step.
            deadline = time.monotonic() + 20
            while True:
                before = await _steps(s, qwen_server.base)
                await asyncio.sleep(1.5)
                if await _steps(s, qwen_server.base) == before or time.monotonic() > deadline:
                    break
            assert await _steps(s, qwen_server.base) == before
            held = await _held(s, qwen_server.base)
            assert held["active_streams"] == 1 and held["kv_pages_used"] > 0
            await ws.send_json({"type": "append", "text": TEXT[cut:]})
            await ws.send_json({"type": "end"})
            await _until(ws, audio, "done")
        assert b"".join(audio) == whole  # resumed where it was: the whole text's audio
        assert not any((await _nothing_held_within(s, qwen_server.base, 10)).values())


async def test_text_past_one_generations_capacity_closes_with_1008_and_frees_all(qwen_server):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, 1)
            await ws.send_json({"type": "append", "text": "Hello there, how are"})
            await _first_audio(ws, [])  # running, waiting for text

            async def flood() -> None:
                # Unknown words (several tokens each) past the 600 a slot holds, and more while the
                # server refuses them: its close must still reach a client that keeps sending.
                while not ws.closed:
                    try:
                        await ws.send_json({"type": "append", "text": " zqxv plughj wvbk" * 60})
                    except (ConnectionError, RuntimeError):  # the session closed meanwhile
                        return
                    await asyncio.sleep(0.005)

            sending = asyncio.create_task(flood())
            await asyncio.sleep(1.0)  # reading later: the server's close waits for the client's
            events: list[dict] = []
            while True:
                msg = await ws.receive(timeout=60)
                if msg.type == aiohttp.WSMsgType.TEXT:
                    events.append(json.loads(msg.data))
                elif msg.type != aiohttp.WSMsgType.BINARY:
                    break
            await sending
        errors = [e for e in events if e["type"] == "error"]
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1008, msg
        assert (
            len(errors) == 1 and errors[0]["fatal"] and "one generation holds at most" in errors[0]["message"]
        )
        assert not any((await _nothing_held_within(s, qwen_server.base, 10)).values())


async def test_clear_frees_the_generation_and_the_session_speaks_on(qwen_server):
    seed = 8
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, seed, temperature=0.0)
            audio: list[bytes] = []
            await ws.send_json({"type": "append", "text": TEXT})
            await _first_audio(ws, audio)
            await ws.send_json({"type": "clear"})
            cleared = await _until(ws, [], "cleared")
            assert cleared["segments"] == 1
            deadline = time.monotonic() + 10  # (the session and its next utterance stay registered)
            while (held := await _held(s, qwen_server.base))["kv_pages_used"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert held["kv_pages_used"] == 0 and held["active_streams"] == 0
            after: list[bytes] = []
            await ws.send_json({"type": "append", "text": "And now something else."})
            await ws.send_json({"type": "end"})
            done = await _until(ws, after, "done")
            assert done["usage"]["segments"] == 2 and after
        # The utterance after the clear is generation 1 of the session: seed + 1.
        body = dict(model="qwen3-tts-tiny", input="And now something else.", voice="ryan", seed=seed + 1)
        body |= dict(response_format="pcm", non_streaming_mode=False, temperature=0.0, **FRAMES)
        async with s.post(qwen_server.base + "/v1/audio/speech", json=body) as r:
            assert await r.read() == b"".join(after)


async def test_a_clear_after_the_end_stops_the_audio_and_the_session_is_done(qwen_server):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, 4)
            await ws.send_json({"type": "append", "text": TEXT})
            await ws.send_json({"type": "end"})
            await _first_audio(ws, [])
            await ws.send_json({"type": "clear"})
            assert (await _until(ws, [], "cleared"))["segments"] == 1
            done = await _until(ws, [], "done")
            assert done["usage"]["segments"] == 1, done
        assert not any((await _nothing_held_within(s, qwen_server.base, 10)).values())


async def test_a_session_that_asks_for_the_whole_text_mode_is_segmented(qwen_server):
    async with aiohttp.ClientSession() as s:
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await ws.send_json(_open(2, non_streaming_mode="true"))
            started = await _next_event(ws, [])
    assert started["type"] == "session.started" and started["mode"] == "segmented", started


async def test_a_client_that_vanishes_while_its_text_runs_out_leaves_nothing_held(qwen_server):
    async with aiohttp.ClientSession() as s:
        ws = await s.ws_connect(qwen_server.base + PATH)
        await _started(ws, 3)
        await ws.send_json({"type": "append", "text": "Hello there, how are"})
        await _first_audio(ws, [])
        await ws.close()
        assert not any((await _nothing_held_within(s, qwen_server.base, 10)).values())
        async with s.ws_connect(qwen_server.base + PATH) as ws:
            await _started(ws, 3)
            await ws.send_json({"type": "end"})
            assert (await _until(ws, [], "done"))["usage"]["segments"] == 0  # nothing to speak


@contextlib.contextmanager
def _pieces_sent(port: int) -> Iterator[list[TextPiece]]:
    """The text pieces the gateway sends the tokenizer pool (its tap's AppendTexts) while open."""
    pieces: list[TextPiece] = []
    stop = threading.Event()
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    for addr in find_taps(port):
        sock.connect(addr)

    def read() -> None:
        while not stop.is_set():
            if not sock.poll(50):
                continue
            header, payload = sock.recv_multipart()
            if msgspec.msgpack.decode(header, type=TapHeader).proc != "gateway":
                continue
            try:
                pieces.extend(msgspec.msgpack.decode(payload, type=AppendText).pieces)
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass  # another message

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # a tap reads new subscriptions every 50 ms
    try:
        yield pieces
    finally:
        stop.set()
        reader.join(5)
        sock.close()


async def test_a_held_back_word_waits_for_more_text_and_goes_upstream_once(qwen_server):
    """The tokenizer holds the last word back (it may go on); the session sends it again only with
    more text, a flush or the end, so a session waiting for text sends nothing upstream."""
    with _pieces_sent(qwen_server.port) as pieces:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(qwen_server.base + PATH) as ws:
                await ws.send_json(_open(6))
                started = await _next_event(ws, [])
                rid = started["session"] + "/0"
                await ws.send_json({"type": "append", "text": "Hello there, how are"})
                await _first_audio(ws, [])  # running, waiting for text; "are" held back
                sent = len(pieces)
                await asyncio.sleep(1.0)
                assert len(pieces) == sent, "nothing goes upstream while the session waits"
                await ws.send_json({"type": "append", "text": " you"})
                await ws.send_json({"type": "end"})
                await _until(ws, [], "done")
        await asyncio.sleep(0.2)
    mine = [(p.text, p.final) for p in pieces if p.rid == rid]
    assert mine == [("Hello there, how are", False), (" are you", False), (" you", True)], mine


async def test_bench_ws_appends_word_by_word_over_concurrent_sessions(qwen_server):
    args = _args(["--sentences", "1", "--max-tokens", "70", "--min-tokens", "40"])
    model = await asyncio.to_thread(server_model, qwen_server.base)
    level = await run_level(qwen_server.base, 3, 5.0, args, model)
    assert level["mode"] == ["native"] and level["ok"] == 3 and level["n_errors"] == 0, level
    assert 0 < level["first_audio_ms"]["p50"] <= level["first_audio_ms"]["p99"]
    assert level["end_to_done_ms"]["p50"] == level["end_to_done_ms"]["p50"]  # measured (not nan)
    assert level["audio_s"] >= 3 * 40 / 12.5 * 0.99
    lag = level["client_lag_ms"]  # the client's own loop: a client-bound result shows here
    assert 0 <= lag["p50"] <= lag["p99"] <= lag["max"] < 1000 * level["wall_s"], level
    assert 0 < level["client_cpu"] < 2, level
    # the sessions that ran dry, if any, say how far behind and where
    late = round(3 * (1 - level["no_underrun"]))
    assert len(level["late_examples"]) == late == level["late_requests"], level
    assert (level["late_worst_ms_p50"] == 0.0) == (late == 0), level
    for example in level["late_examples"]:
        assert example["worst_late_ms"] > 0 and example["first_late_chunk"] >= 1, example
