"""The optional API key: every endpoint but /health and /ready answers 401 (with
`WWW-Authenticate: Bearer` and a JSON error, OpenAI's shape under /v1/) unless the request carries
`Authorization: Bearer <key>`; the key never appears on any process's command line, and only the
gateway's environment holds it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.config import GatewaySettings, ServeConfig
from common.ipc import Addresses
from gateway.server import build_app
from tests.conftest import Server, get_json
from tests.specs import announce

KEY = "vp-test-7f3a9c1e5b"


@pytest.fixture
async def client(tmp_path: Path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    run = tmp_path / "run"
    cfg = ServeConfig(
        model="orpheus-tiny",
        addresses=Addresses.local(str(run)),
        gateway=GatewaySettings(api_key_file=str(key_file)),
    )
    c = TestClient(TestServer(build_app(cfg)))
    await c.start_server()
    await announce(c.app, cfg.addresses, cfg.model)
    yield c
    await c.close()


async def test_requests_without_the_key_get_401_with_a_bearer_challenge(client: TestClient) -> None:
    bad = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
    for path, method in [
        ("/generate", "POST"),
        ("/v1/audio/speech", "POST"),
        ("/v1/models", "GET"),
        ("/v1/models/orpheus-tiny", "GET"),
        ("/metrics", "GET"),
        ("/openapi.json", "GET"),
        ("/no/such/path", "GET"),
    ]:
        for headers in bad:
            resp = await client.request(method, path, headers=headers, json={"text": "hi"})
            case = f"{method} {path} {headers}"
            assert resp.status == 401, case
            assert resp.headers["WWW-Authenticate"].startswith("Bearer"), case
            err = (await resp.json())["error"]
            if path.startswith("/v1/"):
                assert err["code"] == "invalid_api_key" and "Bearer" in err["message"], case
            else:
                assert "Bearer" in err, case
    for path in ("/health", "/ready"):  # for load balancers and orchestrators
        resp = await client.get(path)
        assert resp.status != 401


async def test_the_right_key_passes(client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        resp = await client.get(path, headers=auth)
        assert resp.status == 200, path
    resp = await client.post("/generate", headers=auth, json={"text": ""})
    assert resp.status == 400  # past the key, on to validation
    doc = await (await client.get("/openapi.json", headers=auth)).json()
    assert doc["security"] == [{"bearer": []}] and doc["paths"]["/health"]["get"]["security"] == []
    assert "401" in doc["paths"]["/v1/audio/speech"]["post"]["responses"]


def test_an_empty_key_file_is_refused_at_startup(tmp_path: Path) -> None:
    from gateway.auth import load_api_key

    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="--api-key-file"):
        load_api_key(ServeConfig(gateway=GatewaySettings(api_key_file=str(empty))))
    with pytest.raises(ValueError, match="--api-key-file"):
        load_api_key(ServeConfig(gateway=GatewaySettings(api_key_file=str(tmp_path / "missing"))))
    assert load_api_key(ServeConfig(), {"VOXPIPE_API_KEY": " k "}) == "k"
    assert load_api_key(ServeConfig(), {}) is None


def test_served_key_is_on_no_command_line_and_only_in_the_gateways_environment() -> None:
    srv = Server("--tokenizer-workers", "1", env={"VOXPIPE_API_KEY": KEY})
    try:
        _, ready = get_json(srv.base + "/ready")
        pids = {p["role"]: p["pid"] for p in ready["processes"]}
        assert set(pids) == {"gateway", "tokenizer_worker", "gpu_worker", "codec_worker"}
        for role, pid in [*pids.items(), ("serve", srv.proc.pid)]:
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), role
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert (KEY.encode() in environ) == (role in ("gateway", "serve")), role
        code, _ = get_json(srv.base + "/v1/models")
        assert code == 401
        status, audio = asyncio.run(_speak(srv.base, {"Authorization": f"Bearer {KEY}"}))
        assert status == 200 and audio[:4] == b"RIFF"
    finally:
        srv.stop()


async def _speak(base: str, headers: dict[str, str]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.post(base + "/generate", json={"text": "Hi.", "max_tokens": 60}) as r:
            return r.status, await r.read()
