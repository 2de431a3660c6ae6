"""A request body that does not arrive within --body-timeout gets 408 and its connection closes:
a client sending 10 of 1,000 bytes and stalling holds neither a handler nor a socket for long."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from common.config import ServeConfig
from common.options import parse_role
from gateway.server import GATEWAY
from tests.test_gateway import Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)

TIMEOUT_S = 0.5


@pytest.mark.parametrize(
    "path, ctype",
    [
        ("/generate", "application/json"),
        ("/generate", "application/x-www-form-urlencoded"),
        ("/v1/audio/speech", "application/json"),
    ],
)
async def test_a_body_that_stalls_gets_408_and_the_connection_closes(rig: Rig, path: str, ctype: str) -> None:
    pipeline = rig.client.app[GATEWAY]
    cfg = pipeline.cfg
    pipeline.cfg = msgspec.structs.replace(
        cfg, gateway=msgspec.structs.replace(cfg.gateway, body_timeout=TIMEOUT_S)
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", rig.client.port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: 1000\r\n\r\n".encode()
        + b'{"text": "'
    )
    await writer.drain()
    started = time.monotonic()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 408"), head
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 2
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    assert "--body-timeout" in json.dumps(json.loads(await reader.readexactly(length)))
    # closed at once, not after aiohttp's lingering read of the body that is not coming
    assert await asyncio.wait_for(reader.read(), 2) == b"", "the connection stays open"
    writer.close()
    # The gateway serves on: a prompt body is read as before.
    resp = await rig.client.post(path, data=b"{}", headers={"Content-Type": "application/json"})
    assert resp.status == 400


def test_the_body_timeout_is_a_setting_with_a_default() -> None:
    assert ServeConfig().gateway.body_timeout == 30.0
    assert parse_role("gateway", ["--body-timeout", "5"], {}).cfg.gateway.body_timeout == 5.0
    assert parse_role("gateway", [], {"VOXPIPE_BODY_TIMEOUT": "7.5"}).cfg.gateway.body_timeout == 7.5
    with pytest.raises(ValueError, match="--body-timeout"):
        ServeConfig(gateway=msgspec.structs.replace(ServeConfig().gateway, body_timeout=0)).gateway.check()
