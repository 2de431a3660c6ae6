"""A gateway that starts before any tokenizer worker has announced the model answers speech, model
and schema requests with a clear 503 (/health as always, /ready not ready), then serves once the
spec arrives over the wire."""

# ruff: noqa: F811 (the fixture comes from tests/test_gateway.py; tests take it by name)

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from common.config import ServeConfig
from common.ipc import Addresses, AsyncPushChannel
from common.messages import GatewayInMsg, ProcState, ProcStatus
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

        # Every process READY, no spec yet (it travels on another socket): not ready.
        statuses = AsyncPushChannel[GatewayInMsg](addrs.gateway_in, bind=False)

        async def report_ready() -> None:
            for name in ("gpu_worker", "codec_worker", "tokenizer_worker.0"):
                role = name.split(".")[0]
                await statuses.send(ProcStatus(name, role, 4242, ProcState.READY, time=time.time()))
            await asyncio.sleep(0.1)

        try:
            await report_ready()
            ready = await client.get("/ready")
            body = await ready.json()
            assert ready.status == 503 and body["model"] == "orpheus-tiny"
            assert {p["state"] for p in body["processes"]} == {"ready"}
            await announce(client.app, addrs, cfg.model)
            await report_ready()
            assert (await client.get("/ready")).status == 200
        finally:
            statuses.close()
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "orpheus-tiny" and models["data"][0]["default_voice"] == "tara"
        assert (await client.get("/openapi.json")).status == 200
    finally:
        await client.close()
