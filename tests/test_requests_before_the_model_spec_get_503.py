"""A gateway that starts before any tokenizer worker has announced the model answers speech, model
and schema requests with a clear 503 (and /health, /ready as always), then serves once the spec
arrives over the wire."""

# ruff: noqa: F811 (the fixture comes from tests/test_gateway.py; tests take it by name)

from __future__ import annotations

from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from common.config import ServeConfig
from common.ipc import Addresses
from gateway.server import build_app
from tests.specs import announce
from tests.test_gateway import make_addrs  # noqa: F401 (fixture)


async def test_requests_before_the_spec_get_503_then_are_served(make_addrs: Callable[[], Addresses]) -> None:
    addrs = make_addrs()
    cfg = ServeConfig(model="orpheus-tiny", addresses=addrs)
    client = TestClient(TestServer(build_app(cfg)))
    await client.start_server()
    try:
        for method, path, body in [
            ("POST", "/generate", {"text": "hi"}),
            ("POST", "/v1/audio/speech", {"model": "orpheus-tiny", "input": "hi"}),
            ("GET", "/v1/models", None),
            ("GET", "/openapi.json", None),
        ]:
            resp = await client.request(method, path, json=body)
            error = (await resp.json())["error"]
            message = error["message"] if path.startswith("/v1/") else error
            assert resp.status == 503 and "no tokenizer worker has announced the model" in message, path
        assert (await client.get("/health")).status == 200
        ready = await client.get("/ready")
        assert ready.status == 503 and (await ready.json())["model"] == "orpheus-tiny"

        await announce(client.app, addrs, cfg.model)
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "orpheus-tiny" and models["data"][0]["default_voice"] == "tara"
        assert (await client.get("/openapi.json")).status == 200
    finally:
        await client.close()
