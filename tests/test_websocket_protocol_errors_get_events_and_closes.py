"""The WebSocket session's protocol at the gateway, over a real WebSocket client: what the client
may not send gets an `error` event (fatal: then a close with 1003 or 1008; else the session goes
on), the API key is checked from the header or the session message, and a silent idle session is
closed with 1000. The gateway runs in-process with the model's spec announced and no workers: none
of this needs audio."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.config import GatewaySettings, ServeConfig
from common.ipc import Addresses
from common.options import parse_role
from gateway.server import build_app
from tests.specs import announce

KEY = "vp-ws-3c9e1a"
PATH = "/v1/audio/speech/stream"
IDLE_S = 0.5
SESSION = {"type": "session", "model": "orpheus-tiny", "voice": "tara"}


@pytest.fixture
async def client(tmp_path: Path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    cfg = ServeConfig(
        model="orpheus-tiny",
        addresses=Addresses.local(str(tmp_path / "run")),
        gateway=GatewaySettings(api_key_file=str(key_file), ws_idle_timeout=IDLE_S, max_text_chars=50),
    )
    c = TestClient(TestServer(build_app(cfg, submit_timeout_s=30)))
    await c.start_server()
    await announce(c.app, cfg.addresses, cfg.model)
    yield c
    await c.close()


AUTH = {"Authorization": f"Bearer {KEY}"}


async def _events_until_close(ws: aiohttp.ClientWebSocketResponse) -> tuple[list[dict], aiohttp.WSMessage]:
    events = []
    while True:
        msg = await ws.receive(timeout=10)
        if msg.type != aiohttp.WSMsgType.TEXT:
            return events, msg
        events.append(json.loads(msg.data))


async def _fatal(client: TestClient, *messages: dict | str | bytes) -> tuple[dict, int]:
    """Send `messages` on a new session; the fatal error event and the close code that follow."""
    async with client.ws_connect(PATH, headers=AUTH) as ws:
        for m in messages:
            if isinstance(m, bytes):
                await ws.send_bytes(m)
            elif isinstance(m, str):
                await ws.send_str(m)
            else:
                await ws.send_json(m)
        events, close = await _events_until_close(ws)
    assert close.type == aiohttp.WSMsgType.CLOSE, close
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["fatal"] is True, events
    return errors[0], close.data


async def test_what_the_server_cannot_read_ends_the_session_with_1003_or_1008(client: TestClient) -> None:
    error, code = await _fatal(client, SESSION, b"\x00\x01")
    assert code == 1003 and "binary frames" in error["message"]
    error, code = await _fatal(client, SESSION, "{not json")
    assert code == 1008 and "not valid JSON" in error["message"]
    error, code = await _fatal(client, SESSION, "[1, 2]")
    assert code == 1008 and "JSON object" in error["message"]
    error, code = await _fatal(client, {"type": "append", "text": "hi"})
    assert code == 1008 and error["param"] == "type" and "session" in error["message"]
    error, code = await _fatal(client, b"\x00")
    assert code == 1003
    async with client.ws_connect(PATH, headers=AUTH) as ws:
        await ws.send_json(SESSION)
        await ws.send_json({"type": "append", "text": "x" * (1 << 20)})  # over 1 MiB
        events, close = await _events_until_close(ws)
    assert [e["type"] for e in events] == ["session.started"] and close.data == 1009, close


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("temperature", "hot", "temperature"),
        ("voice", "nobody", "unknown voice"),
        ("response_format", "mp3", "unsupported response_format"),
        ("model", "gpt-5", "not served here"),
        ("volume", 11, "unknown field"),
        ("max_tokens", 10**6, "max_tokens"),
    ],
)
async def test_a_bad_session_field_is_named_and_closes_with_1008(
    client: TestClient, field: str, value, says: str
) -> None:
    error, code = await _fatal(client, {**SESSION, field: value})
    assert code == 1008 and error["param"] == field and says in error["message"], error


async def test_refused_messages_get_an_error_and_the_session_goes_on(client: TestClient) -> None:
    async with client.ws_connect(PATH, headers=AUTH) as ws:
        await ws.send_json(SESSION)
        started = json.loads((await ws.receive()).data)
        assert started["type"] == "session.started" and started["mode"] == "segmented"
        refused = [
            {"type": "dance"},
            {"type": "append", "text": 5},
            {"type": "append", "text": "hi", "speed": 2},
            {"type": "session", **SESSION},
            {"type": "append", "text": "x" * 51},  # past --max-text-chars 50
            '{"type": "append", "text": "\\ud800"}',  # a lone surrogate: no Unicode text
        ]
        for m in refused:
            await (ws.send_str(m) if isinstance(m, str) else ws.send_json(m))
            event = json.loads((await ws.receive()).data)
            assert event["type"] == "error" and event["fatal"] is False, (m, event)
        await ws.send_json({"type": "append", "text": "x" * 50})  # exactly the limit
        assert json.loads((await ws.receive()).data) == {"type": "ack", "seq": 1, "characters": 50}
        await ws.send_json({"type": "end"})  # the text waits for a tokenizer worker (there is none)
        await ws.send_json({"type": "append", "text": "more"})
        after_end = json.loads((await ws.receive()).data)
        assert (
            after_end["type"] == "error"
            and after_end["fatal"] is False
            and "after end" in after_end["message"]
        )
        await ws.send_json({"type": "clear"})  # aborts the waiting segment; nothing is left to say
        events, close = await _events_until_close(ws)
    assert [e["type"] for e in events] == ["cleared", "done"] and events[0][
        "segments"
    ] == 2  # 50 bytes: two segments of the 42-byte budget
    assert events[1]["usage"]["characters"] == 50 and events[1]["usage"]["audio_seconds"] == 0
    assert close.type == aiohttp.WSMsgType.CLOSE and close.data == 1000


async def test_the_key_comes_in_the_header_or_the_session_message(client: TestClient) -> None:
    async with client.ws_connect(PATH) as ws:  # a browser cannot set headers
        await ws.send_json({**SESSION, "api_key": KEY})
        assert json.loads((await ws.receive()).data)["type"] == "session.started"
    for key in (None, "wrong"):
        extra = {} if key is None else {"api_key": key}
        async with client.ws_connect(PATH) as ws:
            await ws.send_json({**SESSION, **extra})
            events, close = await _events_until_close(ws)
        assert close.data == 1008 and events[0]["param"] == "api_key" and events[0]["fatal"], events
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect(PATH, headers={"Authorization": "Bearer wrong"})
    assert refused.value.status == 401
    resp = await client.get(PATH, headers=AUTH)  # no upgrade
    assert resp.status == 400 and "WebSocket" in (await resp.json())["error"]["message"]


async def test_an_idle_session_is_closed_with_1000(client: TestClient) -> None:
    for opening in ([], [SESSION]):
        async with client.ws_connect(PATH, headers=AUTH) as ws:
            for m in opening:
                await ws.send_json(m)
            events, close = await _events_until_close(ws)
        assert close.type == aiohttp.WSMsgType.CLOSE and close.data == 1000
        assert f"for {IDLE_S:g} s" in close.extra, close
        assert [e["type"] for e in events] == ["session.started"] * len(opening)


async def test_a_session_with_text_to_speak_is_not_idle(client: TestClient) -> None:
    async with client.ws_connect(PATH, headers=AUTH) as ws:
        await ws.send_json(SESSION)
        assert json.loads((await ws.receive()).data)["type"] == "session.started"
        await ws.send_json({"type": "append", "text": "Waits for a tokenizer worker"})
        await ws.send_json({"type": "flush"})  # a segment is pending: the session is busy
        assert json.loads((await ws.receive()).data)["type"] == "ack"
        with pytest.raises(asyncio.TimeoutError):
            await ws.receive(timeout=3 * IDLE_S)  # no close while it waits
        await ws.send_json({"type": "clear"})
        t0 = time.monotonic()
        events, close = await _events_until_close(ws)
    assert [e["type"] for e in events] == ["cleared"] and close.data == 1000
    assert IDLE_S * 0.9 <= time.monotonic() - t0 < IDLE_S + 1.5  # quiet from the clear on


async def test_a_shutdown_closes_the_open_sessions_with_1001(client: TestClient) -> None:
    async with client.ws_connect(PATH, headers=AUTH) as ws:
        await ws.send_json(SESSION)
        assert json.loads((await ws.receive()).data)["type"] == "session.started"
        await client.app.shutdown()
        events, close = await _events_until_close(ws)
    assert close.data == 1001 and events[0]["fatal"] and "shutting down" in events[0]["message"], events


def test_the_idle_timeout_is_a_setting_with_a_default() -> None:
    assert ServeConfig().gateway.ws_idle_timeout == 60.0
    assert parse_role("gateway", ["--ws-idle-timeout", "5"], {}).cfg.gateway.ws_idle_timeout == 5.0
    env = {"VOXPIPE_WS_IDLE_TIMEOUT": "7.5"}
    assert parse_role("gateway", [], env).cfg.gateway.ws_idle_timeout == 7.5
    with pytest.raises(ValueError, match="--ws-idle-timeout"):
        bad = msgspec.structs.replace(ServeConfig().gateway, ws_idle_timeout=0)
        bad.check()
