"""A 405 carries the `Allow` header (RFC 9110 §15.5.6) on every endpoint, OpenAI's included."""

# ruff: noqa: F811 (the rig fixtures come from tests/test_gateway.py; tests take them by name)

from __future__ import annotations

from tests.test_gateway import Rig, make_addrs, rig, start_rig  # noqa: F401 (fixtures)


async def test_405_names_the_allowed_methods_in_allow(rig: Rig) -> None:
    for method, path, allowed in [
        ("GET", "/generate", {"POST"}),
        ("PUT", "/v1/audio/speech", {"POST"}),
        ("DELETE", "/health", {"GET", "HEAD"}),
    ]:
        resp = await rig.client.request(method, path)
        assert resp.status == 405, (method, path)
        assert {m.strip() for m in resp.headers.get("Allow", "").split(",") if m.strip()} == allowed
