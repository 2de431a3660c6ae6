"""The optional API key: a Bearer token every HTTP endpoint but `/health` and `/ready` requires.

The key comes from `VOXPIPE_API_KEY` or from the file `--api-key-file` names, never from a flag:
`voxpipe serve` hands each child its config as JSON on the command line, which any local user can
read in `ps`, so the config holds only the file's path, and the launcher passes the variable to
the gateway alone. `/health` and `/ready` stay open for load balancers and orchestrators (they say
nothing about requests); `/metrics` needs the key (request counts and worker state are the
operator's business: Prometheus sends it with `authorization: {credentials_file: ...}`).

A WebSocket client cannot always set headers (a browser's `WebSocket` cannot), so on the paths in
`KEY_IN_FIRST_MESSAGE` a request without an `Authorization` header is let through marked
`UNVERIFIED`, and the handler takes the key from the session's first message (`key_matches`); a
header that is there must hold the key. The key never goes in a URL: URLs end up in access logs.

Comparison is constant-time (`hmac.compare_digest`), so the time a refusal takes says nothing
about how much of a guess was right.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from common.config import ServeConfig

log = logging.getLogger(__name__)

ENV = "VOXPIPE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready"})
KEY_IN_FIRST_MESSAGE = frozenset({"/v1/audio/speech/stream"})
# Set on a request let through without a header: its handler must check the key itself.
UNVERIFIED: Any = (
    web.RequestKey("voxpipe_key_unverified", bool) if hasattr(web, "RequestKey") else "voxpipe_key_unverified"
)


def key_matches(token: str, expected: bytes) -> bool:
    """`token` is the key (constant-time)."""
    return hmac.compare_digest(token.strip().encode("utf-8", "replace"), expected)


def load_api_key(cfg: ServeConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """The key from --api-key-file (first line, stripped) or VOXPIPE_API_KEY; None = no key.
    Raises ValueError naming the setting when the file is unreadable or empty."""
    environ = os.environ if environ is None else environ
    if cfg.gateway.api_key_file:
        try:
            with open(cfg.gateway.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
            mode = os.stat(cfg.gateway.api_key_file).st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {cfg.gateway.api_key_file!r} cannot be read: {e}") from None
        if not key:
            raise ValueError(
                f"--api-key-file {cfg.gateway.api_key_file!r} is empty; put the key on its first line"
            )
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning(
                "--api-key-file %s is readable by other users; chmod 600 it", cfg.gateway.api_key_file
            )
        return key
    return environ.get(ENV, "").strip() or None


def middleware(key: str, error_body: Any) -> Any:
    """An aiohttp middleware answering 401 (with `WWW-Authenticate: Bearer`) to a request without
    `Authorization: Bearer <key>`; `error_body(status, message)` gives OpenAI's error object."""
    expected = key.encode()

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if request.path in KEY_IN_FIRST_MESSAGE and "Authorization" not in request.headers:
            request[UNVERIFIED] = True
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key_matches(token, expected):
            return await handler(request)
        given = bool(token.strip()) and scheme.lower() == "bearer"
        message = (
            "the API key is not valid; send Authorization: Bearer <the server's VOXPIPE_API_KEY>"
            if given
            else "this server requires an API key; send Authorization: Bearer <key>"
        )
        challenge = 'Bearer realm="voxpipe"' + (', error="invalid_token"' if given else "")
        headers = {"WWW-Authenticate": challenge}
        if request.path.startswith("/v1/"):
            body: dict[str, Any] = {"error": error_body(401, message, code="invalid_api_key")}
        else:
            body = {"error": message}
        return web.json_response(body, status=401, headers=headers)

    return require_key
