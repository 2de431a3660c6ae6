"""Text holding a lone UTF-16 surrogate (JSON `"\\ud800"`: no Unicode text, no UTF-8 form) gets a
400 that says so on both speech endpoints, and the gateway serves on; a surrogate pair is text."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import json

import pytest

from common.messages import FinishReason
from tests.test_gateway import Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"text": "\ud800"}),
        ("/generate", {"text": "Hello \udfff there, and more text after it."}),
        ("/generate", {"text": "Hello", "voice": "tara\ud800"}),
        ("/v1/audio/speech", {"model": "tts-1", "input": "\ud800", "voice": "tara"}),
        ("/v1/audio/speech", {"model": "tts-1", "input": "hi", "voice": "tara", "x": ["\udc00"]}),
    ],
)
async def test_a_lone_surrogate_gets_400(rig: Rig, path: str, body: dict) -> None:
    raw = json.dumps(body)  # ASCII with \\u escapes: the surrogate travels as JSON allows
    resp = await rig.client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert "surrogate" in json.dumps(await resp.json())


async def test_a_surrogate_pair_is_text_and_is_spoken(rig: Rig) -> None:
    task = rig.post(
        data=json.dumps({"text": "smile \ud83d\ude00"}), headers={"Content-Type": "application/json"}
    )
    req = await rig.workers.next_request()
    assert req.text == "smile \U0001f600"
    await rig.workers.audio(req.rid, b"\0\0" * 10, finish=FinishReason.STOP)
    assert (await task).status == 200
