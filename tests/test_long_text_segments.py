"""Long text: split at sentence ends into segments one generation can speak, generated one after
another, and joined without a click. Unit tests of the rule, then the gateway over real HTTP and ZMQ
with the test playing the workers."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import random

import aiohttp
import numpy as np
import pytest

from common.config import GatewaySettings, GpuWorkerSettings, ServeConfig
from common.messages import Abort, FinishReason, RequestError
from gateway.segments import (
    FADE_S,
    MAX_TEXT_CHARS_LIMIT,
    Joiner,
    segment_budget,
    split_text,
    text_limit,
)
from gateway.validation import max_tokens_limit
from tests.specs import model_spec
from tests.test_gateway import SAMPLE_RATE, Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

FADE = round(FADE_S * SAMPLE_RATE)
THREE_SENTENCES = "The first sentence is here. The second one follows it. And a third ends it."
WORDS = "the a voice model speaks every word of this text in order and never drops one".split()


def _size(text: str) -> int:
    return len(text.encode())


def test_segment_budget_follows_the_documented_rule() -> None:
    # floor((max_tokens - 12 prompt tokens) / (1 + 82.03 tokens/s / 10 bytes/s))
    assert segment_budget(model_spec("orpheus"), 1200) == 129
    assert segment_budget(model_spec("orpheus-tiny"), 400) == 42
    tiny = model_spec("orpheus-tiny")
    assert (
        segment_budget(tiny, max_tokens_limit(tiny, ServeConfig(gpu=GpuWorkerSettings(max_context=200))))
        == 20
    )
    assert (
        text_limit(ServeConfig(gateway=GatewaySettings(max_text_chars=10**9)))
        == MAX_TEXT_CHARS_LIMIT
        == 50_000
    )


def _random_text(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(1, 30)):
        words = rng.choices(WORDS + ["naïve", "日本語の文", "x" * rng.randint(1, 60)], k=rng.randint(1, 25))
        sep = rng.choice([", ", " ", "; ", " — "])
        out.append(sep.join(words) + rng.choice([".", "!", "?", "。", "…", ".\n\n", '."']))
    return rng.choice(["", "  "]) + " ".join(out) + rng.choice(["", "\n"])


@pytest.mark.parametrize("budget", [7, 20, 42, 129])
def test_split_keeps_every_character_in_order_within_the_budget(budget: int) -> None:
    rng = random.Random(budget)
    for _ in range(200):
        text = _random_text(rng)
        segments = split_text(text, budget)
        assert "".join("".join(s.split()) for s in segments) == "".join(text.split())
        for s in segments:
            assert s and s == s.strip()
            assert _size(s) <= budget or len(s) == 1, (s, budget)
            assert s in text  # a slice of the input: spacing inside a segment is kept


def test_split_cuts_at_sentence_ends_when_sentences_fit() -> None:
    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(2, 6))).capitalize() + "." for _ in range(40)]
    segments = split_text(" ".join(sentences), 129)
    assert len(segments) > 5 and all(s.endswith(".") for s in segments)
    assert split_text("One. Two.", 129) == ["One. Two."]  # fits: one segment, untouched


def test_split_makes_segments_of_even_size_rather_than_full_ones_and_a_scrap() -> None:
    text = " ".join(f"Sentence number {i:02d} is here." for i in range(8))  # 8 x 27 bytes
    sizes = [_size(s) for s in split_text(text, 129)]
    assert len(sizes) == 2 and max(sizes) - min(sizes) <= 28  # 4 + 4 sentences, not 4 + 4 + 0
    assert [_size(s) for s in split_text("a" * 100, 42)] == [33, 33, 34]
    assert split_text("日本語の文はここで終わる。", 12) == [
        "日本語",
        "の文は",
        "ここで",
        "終わる。",
    ]  # 39 bytes: 4 pieces


def _segment(value: int, n: int) -> list[bytes]:
    return [np.full(k, value, dtype="<i2").tobytes() for k in (n // 2, n - n // 2)]


def test_joiner_fades_each_join_without_a_step_and_keeps_the_length() -> None:
    joiner = Joiner(FADE)
    segments = [_segment(12000, 3000), _segment(-12000, 2500), _segment(9000, 100), _segment(12000, 4000)]
    out = b""
    for k, chunks in enumerate(segments):
        joiner.start(last=k == len(segments) - 1)
        for chunk in chunks:
            out += joiner.feed(chunk)
        out += joiner.end()
    x = np.frombuffer(out, dtype="<i2").astype(np.int32)
    assert len(x) == 3000 + 2500 + 100 + 4000  # nothing added, nothing dropped
    assert int(np.abs(np.diff(x)).max()) < 200  # the steps were 24000 and 21000
    assert (x[: 3000 - FADE] == 12000).all() and (x[-(4000 - FADE) :] == 12000).all()  # ends untouched
    assert (x[3000 + FADE : 5500 - FADE] == -12000).all()
    assert abs(x[2999]) < 100 and abs(x[3000]) < 100  # the join itself is near silence


def test_joiner_passes_a_single_segment_through_untouched() -> None:
    joiner = Joiner(FADE)
    joiner.start(last=True)
    chunk = np.arange(-3000, 3000, dtype="<i2").tobytes()
    assert joiner.feed(chunk) == chunk and joiner.end() == b""


async def _no_request(rig: Rig, within: float = 0.3) -> bool:
    try:
        await asyncio.wait_for(rig.workers.recv_requests.recv(), within)
    except asyncio.TimeoutError:
        return True
    return False


async def test_long_text_is_generated_as_consecutive_segments_and_streamed_in_order(rig: Rig) -> None:
    assert split_text(THREE_SENTENCES, 42) == [
        "The first sentence is here.",
        "The second one follows it.",
        "And a third ends it.",
    ]
    task = rig.post(json={"text": THREE_SENTENCES, "seed": 100, "voice": "leo"})
    values = [10000, -10000, 10000]
    sent = 0
    for k, text in enumerate(split_text(THREE_SENTENCES, 42)):
        req = await rig.workers.next_request()
        assert req.rid.endswith(f"/{k}") and req.text == text
        assert (req.sampling.seed, req.model_kwargs) == (100 + k, {"voice": "leo"})
        assert req.urgent == (k > 0), "a later segment's stream is already playing: it goes first"
        assert await _no_request(rig), "the next segment is submitted only when this one has finished"
        await rig.workers.audio(req.rid, *_segment(values[k], 2048 * (k + 1)))
        await rig.workers.audio(req.rid, finish=FinishReason.LENGTH, n_tokens=50)
        sent += 2048 * (k + 1)
        if k == 0:
            resp = await task
            assert resp.status == 200 and req.rid == resp.headers["X-Request-Id"] + "/0"
    body = await resp.read()
    x = np.frombuffer(body[44:], dtype="<i2").astype(np.int32)
    assert len(x) == sent
    assert int(np.abs(np.diff(x)).max()) < 200  # no click at either join
    assert (x[: 2048 - FADE] == 10000).all() and (x[2048 + FADE : 2048 + 4096 - FADE] == -10000).all()


async def test_long_text_without_streaming_is_one_wav_as_long_as_its_segments(rig: Rig) -> None:
    task = rig.post(json={"text": THREE_SENTENCES, "streaming": False})
    for k in range(3):
        req = await rig.workers.next_request()
        await rig.workers.audio(req.rid, *_segment(1000 * (k + 1), 1000), finish=FinishReason.STOP)
    resp = await task
    body = await resp.read()
    assert resp.status == 200 and len(body) == 44 + 2 * 3000


async def test_disconnect_during_a_long_text_aborts_the_segment_in_flight_and_submits_no_more(
    rig: Rig,
) -> None:
    task = rig.post(json={"text": THREE_SENTENCES})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, *_segment(5000, 4096), finish=FinishReason.STOP)
    resp = await task
    await resp.content.readexactly(44 + 2048)
    second = await rig.workers.next_request()
    assert second.rid.endswith("/1")
    resp.close()
    assert await rig.workers.next_gpu_msg() == Abort(rids=[second.rid])
    assert await _no_request(rig)


async def test_a_failed_later_segment_breaks_the_stream(rig: Rig) -> None:
    task = rig.post(json={"text": THREE_SENTENCES})
    req = await rig.workers.next_request()
    await rig.workers.audio(req.rid, *_segment(5000, 4096), finish=FinishReason.STOP)
    resp = await task
    second = await rig.workers.next_request()
    await rig.workers.send(RequestError(rid=second.rid, status=400, message="prompt too long"))
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()
    assert await _no_request(rig)


async def test_max_tokens_too_small_for_a_split_text_is_a_400_saying_what_to_raise(rig: Rig) -> None:
    resp = await rig.client.post("/generate", json={"text": "word " * 20, "max_tokens": 30})
    assert resp.status == 400
    assert "raise max_tokens to at least" in (await resp.json())["error"]
    resp = await rig.client.post(
        "/v1/audio/speech", json={"model": "tts-1", "input": THREE_SENTENCES, "max_tokens": 30}
    )
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "max_tokens" and "at least 67" in error["message"]
