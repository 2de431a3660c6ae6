"""Before any tokenizer worker has announced the model (a gateway that just started or restarted:
they announce every second), the speech endpoints answer 503 with `Retry-After: 1`, so clients
back off for that second instead of counting a failure; settings the model refuses get no
Retry-After (retrying cannot help)."""

# ruff: noqa: F811 (the fixture comes from tests/test_gateway.py; tests take it by name)

from __future__ import annotations

from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from common.config import ServeConfig
from common.ipc import Addresses
from gateway.server import GATEWAY, build_app
from tests.test_gateway import make_addrs  # noqa: F401 (fixture)

ENDPOINTS = [("/generate", {"text": "hi"}), ("/v1/audio/speech", {"model": "orpheus-tiny", "input": "hi"})]


async def test_speech_before_the_spec_gets_retry_after(make_addrs: Callable[[], Addresses]) -> None:
    client = TestClient(TestServer(build_app(ServeConfig(model="orpheus-tiny", addresses=make_addrs()))))
    await client.start_server()
    try:
        for path, body in ENDPOINTS:
            resp = await client.post(path, json=body)
            assert resp.status == 503 and resp.headers.get("Retry-After") == "1", path
        client.app[GATEWAY].spec_error = "--constrained: the model has no constrained sampling mode"
        for path, body in ENDPOINTS:
            resp = await client.post(path, json=body)
            assert resp.status == 503 and "Retry-After" not in resp.headers, path
    finally:
        await client.close()
