"""`GET /v1/audio/speech/stream`: input streaming over a WebSocket, for a client (a voice agent)
whose text arrives while it is being written, e.g. token by token from an LLM.

The client sends JSON text messages; the server sends binary frames of PCM16 (mono, little-endian,
the model's sample rate) in order, and JSON events. The protocol (docs/api.md has it in full):

    client → {"type": "session", "model", "voice", "response_format": "pcm", sampling fields…,
              "api_key"?}                             first message: opens the session
             {"type": "append", "text": "…"}          → {"type": "ack", "seq": n, "characters": total}
             {"type": "flush"}                        speak what is buffered now
             {"type": "end"}                          no more text: speak the rest, then `done`
             {"type": "clear"}                        barge-in: abort it all → {"type": "cleared"}
    server → {"type": "session.started", "session", "model", "sample_rate", "mode": "native" | "segmented"}
             {"type": "audio.started", "index"}, {"type": "segment.done", "index", "text", …}
             {"type": "done", "usage": {…}}           then a close with 1000
             {"type": "error", "message", "param", "fatal"}

A model that takes text appended to a running generation (ModelSpec.append_rows > 0, in the mode
its `append_options` set) is served natively: one generation takes the text as it comes
(`gateway.native`); every other model, or a session whose options set another mode, by incremental
segmentation (`gateway.incremental` cuts the text, `gateway.live` generates and plays the
segments). `mode` in `session.started` says which; the messages are the same.

A message the server cannot read as the protocol (a binary frame: close 1003; not a JSON object,
a first message that is no valid `session`, a wrong API key: close 1008) ends the session after an
`error` event with `"fatal": true`. A message that is readable but refused (an unknown type, an
append after `end` or past --max-text-chars, an unknown field) gets an `error` event with
`"fatal": false` and the session goes on. A generation that fails ends the session (close 1011).
The server pings every HEARTBEAT_S; a session with no client message for --ws-idle-timeout seconds
while nothing is generating is closed with 1000. However a session ends, every generation it
started is aborted upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from aiohttp import WSMessage, WSMsgType, web

from gateway.auth import UNVERIFIED, key_matches
from gateway.body import MAX_BODY_BYTES, BodyError, check_unicode
from gateway.events import ClientGone, Done, Failed
from gateway.fields import BadRequest
from gateway.incremental import Segmenter, SessionParams, parse_session
from gateway.live import LiveSynthesis
from gateway.metrics import outcome_of
from gateway.native import NativeSynthesis
from gateway.openai import openai_error
from gateway.pipeline import Pipeline
from gateway.segments import text_limit

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream"
HEARTBEAT_S = 20.0  # the server pings this often; a client that does not answer is gone
BUSY_POLL_S = 1.0  # while a session generates, how often its reader looks whether it has gone quiet
CLOSE_NORMAL, CLOSE_GOING_AWAY, CLOSE_UNSUPPORTED = 1000, 1001, 1003
CLOSE_POLICY, CLOSE_ERROR, CLOSE_TRY_LATER = 1008, 1011, 1013
MESSAGE_FIELDS = {"append": ("text",), "flush": (), "end": (), "clear": ()}  # besides "type"


class ProtocolError(Exception):
    """A message the session refuses: an `error` event, and a close with `code` when `fatal`."""

    def __init__(self, message: str, fatal: bool, code: int = CLOSE_POLICY, param: str | None = None):
        super().__init__(message)
        self.fatal = fatal
        self.code = code
        self.param = param


class Session:
    """One WebSocket session: reads the client's messages and runs the player task beside them."""

    def __init__(
        self, pipeline: Pipeline, request: web.Request, ws: web.WebSocketResponse, sid: str, key: bytes | None
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.ws = ws
        self.sid = sid
        self.key = key if request.get(UNVERIFIED) else None  # None: no key to check here
        self.idle_s = pipeline.cfg.gateway.ws_idle_timeout
        self.limit = text_limit(pipeline.cfg)
        self.live: LiveSynthesis | NativeSynthesis | None = None
        self.segmenter = Segmenter(1)
        self.n_chars = 0
        self.seq = 0
        self.ended = False
        self.outcome = "cancelled"
        self.admitted = False  # holds an active stream (gateway.admission) until the handler ends
        self._player: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # frames from the reader and the player never interleave
        # The close the player asks for at the session's end (code, reason), which the reader makes
        # (`_receive`), woken by `_wake`: aiohttp's close from a task other than the one receiving
        # closes the socket without waiting for the client's close, and a client still sending
        # then gets a reset that can drop the error event and close frame before it.
        self._end: tuple[int, bytes] | None = None
        self._wake = asyncio.Event()

    async def run(self) -> str:
        """Serve the session; returns its outcome (a metrics label)."""
        try:
            params = await self._open()
            if params is None:
                return self.outcome
        except ProtocolError as e:
            await self._refuse(e)
            return "client_error"
        rejected = await self.pipeline.admission.acquire(self._client_gone)
        if rejected is not None:
            self.pipeline.metrics.rejected.labels(rejected.reason).inc()
            await self._refuse(ProtocolError(rejected.message, True, CLOSE_TRY_LATER))
            return "rejected"
        self.admitted = True
        mode = "native" if native_mode(params, self.pipeline) else "segmented"
        kind = NativeSynthesis if mode == "native" else LiveSynthesis
        live = self.live = kind(self.pipeline, self.request, self.sid, params, self._send_bytes, self.send)
        self.segmenter = Segmenter(params.budget)
        await self.send(
            {
                "type": "session.started",
                "session": self.sid,
                "model": params.model,
                "sample_rate": self.pipeline.sample_rate,
                "format": "pcm_s16le",
                "mode": mode,
            }
        )
        self._player = asyncio.create_task(self._play(live))
        try:
            await self._read(live)
        except ProtocolError as e:
            await self._refuse(e)
            self.outcome = "client_error"
        return self.outcome

    def close(self) -> None:
        """Stop the player and abort every generation the session still holds upstream."""
        if self._player is not None:
            self._player.cancel()
        if self.live is not None:
            self.live.close()

    async def going_away(self) -> None:
        """The gateway is shutting down: stop the audio, say so and close with 1001."""
        if self.live is not None:
            self.live.stop()
        if self._player is not None:
            self._player.cancel()
        await self._refuse(ProtocolError("the server is shutting down; reconnect", True, CLOSE_GOING_AWAY))

    async def send(self, event: dict[str, Any]) -> None:
        async with self._lock:
            await self.ws.send_str(json.dumps(event, separators=(",", ":")))

    # -- reading ----------------------------------------------------------------------------------

    async def _open(self) -> SessionParams | None:
        """The session's parameters from its first message; None when the client left first."""
        data = await self._receive(opening=True)
        if data is None:
            return None
        msg = _parse(data)
        if msg.get("type") != "session":
            raise ProtocolError(
                'the first message must open the session: {"type": "session", "model": …, "voice": …}',
                True,
                param="type",
            )
        token = msg.pop("api_key", None)
        if self.key is not None and not (isinstance(token, str) and key_matches(token, self.key)):
            given = "is not valid" if token else "is missing"
            raise ProtocolError(
                f"the API key {given}: send Authorization: Bearer <key> with the upgrade request, or "
                '"api_key" in the session message',
                True,
                param="api_key",
            )
        spec = self.pipeline.spec
        assert spec is not None, "checked before the upgrade"
        try:
            return parse_session({k: v for k, v in msg.items() if k != "type"}, spec, self.pipeline.cfg)
        except BadRequest as e:
            raise ProtocolError(str(e), True, param=e.param) from None

    async def _receive(self, opening: bool = False) -> str | None:
        """The next text message; None when the client closed or left, or the session idled out:
        no message for idle_s while nothing was generating or waiting to be sent."""
        heard = time.monotonic()
        while True:
            if self._end is not None:  # the player's end: closed here, waiting for the client's close
                code, reason = self._end
                await self.ws.close(code=code, message=reason)
                return None
            live = None if opening else self.live
            busy = live is not None and live.busy and not (self._player is None or self._player.done())
            quiet = heard if live is None else max(heard, live.quiet_since)
            left = min(BUSY_POLL_S, self.idle_s) if busy else quiet + self.idle_s - time.monotonic()
            if left <= 0:
                what = "no session message" if opening else "no message and nothing to speak"
                await self.ws.close(code=CLOSE_NORMAL, message=f"{what} for {self.idle_s:g} s".encode())
                self.outcome = "client_error" if opening else "ok"
                return None
            try:
                msg = await self._next_message(left)
            except asyncio.TimeoutError:
                continue
            if msg is None:  # woken by the player's end
                continue
            if msg.type == WSMsgType.TEXT:
                return msg.data
            if msg.type == WSMsgType.BINARY:
                raise ProtocolError(
                    "binary frames are not part of the protocol; send JSON text messages",
                    True,
                    CLOSE_UNSUPPORTED,
                )
            return None  # CLOSE, CLOSING, CLOSED, ERROR

    async def _next_message(self, timeout: float) -> WSMessage | None:
        """The next WebSocket message within `timeout` (else TimeoutError), or None once the player
        asks for the session's end (`_end`); a message not yet taken stays queued."""
        if self._player is None:
            return await self.ws.receive(timeout=timeout)
        receiving = asyncio.ensure_future(self.ws.receive(timeout=timeout))
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((receiving, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            if not receiving.done():
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await receiving
        return receiving.result() if not receiving.cancelled() else None

    def _end_session(self, code: int, reason: bytes) -> None:
        """The player's end: the reader closes with `code` (`_receive`)."""
        self._end = (code, reason)
        self._wake.set()

    async def _read(self, live: LiveSynthesis | NativeSynthesis) -> None:
        while not self.ws.closed:
            data = await self._receive()
            if data is None:
                return
            try:
                await self._handle(live, _parse(data))
            except ProtocolError as e:
                if e.fatal:
                    raise
                await self._error(str(e), e.param, fatal=False)

    async def _handle(self, live: LiveSynthesis | NativeSynthesis, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "session":
            raise ProtocolError("the session is already open", False, param="type")
        if kind not in MESSAGE_FIELDS:
            raise ProtocolError(
                f"unknown message type {json.dumps(kind)}; types: session, {', '.join(MESSAGE_FIELDS)}",
                False,
                param="type",
            )
        extra = sorted(set(msg) - {"type", *MESSAGE_FIELDS[kind]})
        if extra:
            raise ProtocolError(f"unknown field {extra[0]!r} in a {kind} message", False, param=extra[0])
        if kind == "clear":
            await self._clear(live)
            return
        if self.ended:
            raise ProtocolError(f"{kind} after end: the input has ended", False, param="type")
        if kind == "append":
            self._append(live, msg.get("text"))
            await self.send({"type": "ack", "seq": self.seq, "characters": self.n_chars})
            return
        if isinstance(live, NativeSynthesis):
            if kind == "end":
                self.ended = True
                live.end()
            else:
                live.flush()
            return
        live.add(self.segmenter.flush())
        if kind == "end":
            self.ended = True
            live.end()

    def _append(self, live: LiveSynthesis | NativeSynthesis, text: Any) -> None:
        if not isinstance(text, str):
            raise ProtocolError(f"field 'text' must be a string, got {json.dumps(text)}", False, param="text")
        if self.n_chars + len(text) > self.limit:
            raise ProtocolError(
                f"append refused: the session would hold {self.n_chars + len(text)} characters; the "
                f"limit is {self.limit} (the server's --max-text-chars); end this session and open another",
                False,
                param="text",
            )
        self.n_chars += len(text)
        self.seq += 1
        if isinstance(live, NativeSynthesis):
            live.append(text)
            return
        if live.first_text is None and text.strip():
            live.first_text = time.monotonic()
        live.add(self.segmenter.append(text))

    async def _clear(self, live: LiveSynthesis | NativeSynthesis) -> None:
        """Barge-in: stop the audio, abort every generation, drop the buffered text."""
        if self._player is not None:
            live.stop()
            self._player.cancel()
            await asyncio.gather(self._player, return_exceptions=True)
        n = live.clear()
        self.segmenter.clear()
        await self.send({"type": "cleared", "segments": n})
        self._player = asyncio.create_task(self._play(live))

    # -- the player -------------------------------------------------------------------------------

    async def _play(self, live: LiveSynthesis | NativeSynthesis) -> None:
        """Send the audio until the session's end, then `done` (or a fatal `error`) and close."""
        try:
            result = await live.play()
            if result is None:
                return  # stopped by a clear
            if isinstance(result, Done):
                seconds = live.n_samples / self.pipeline.sample_rate
                usage = {
                    "characters": self.n_chars,
                    "segments": live.next_index,
                    "audio_seconds": round(seconds, 4),
                    "input_tokens": result.n_prompt_tokens,
                    "output_tokens": result.n_tokens,
                }
                await self.send({"type": "done", "usage": usage})
                log.info("[%s] session done: %d chars, %.2f s of audio", self.sid, self.n_chars, seconds)
                self.outcome = "ok"
                self._end_session(CLOSE_NORMAL, b"done")
                return
            assert isinstance(result, Failed)
            log.warning("[%s] a segment failed: %d %s", self.sid, result.status, result.message)
            self.outcome = outcome_of(result.status)
            code = CLOSE_POLICY if 400 <= result.status < 500 else CLOSE_ERROR  # the client's text
            await self._refuse(ProtocolError(result.message, True, code), by_player=True)
        except (ConnectionError, ClientGone):
            log.info("[%s] client disconnected", self.sid)
            self.outcome = "cancelled"
        except Exception:
            log.exception("[%s] the session's player failed", self.sid)
            self.outcome = "server_error"
            await self._refuse(ProtocolError("internal error", True, CLOSE_ERROR), by_player=True)

    # -- sending ----------------------------------------------------------------------------------

    async def _send_bytes(self, pcm: bytes) -> None:
        async with self._lock:
            if self.live is not None and self.live.stopped:
                return  # a clear came while this frame waited: none of its audio follows `cleared`
            await self.ws.send_bytes(pcm)

    async def _error(self, message: str, param: str | None, fatal: bool) -> None:
        await self.send({"type": "error", "message": message, "param": param, "fatal": fatal})

    async def _refuse(self, e: ProtocolError, by_player: bool = False) -> None:
        """A fatal error: the event, then the close (`by_player`: the reader's, `_end_session`)."""
        log.info("[%s] closing the session (%d): %s", self.sid, e.code, e)
        try:
            await self._error(str(e), e.param, fatal=True)
            if by_player:
                self._end_session(e.code, str(e)[:120].encode())
            else:
                await self.ws.close(code=e.code, message=str(e)[:120].encode())
        except ConnectionError:
            pass

    def _client_gone(self) -> bool:
        return self.ws.closed or self.request.transport is None or self.request.transport.is_closing()


def native_mode(params: SessionParams, pipeline: Pipeline) -> bool:
    """Whether the session appends its text to one running generation: the model takes appended
    text, and the session's options leave it in the mode that does (ModelSpec.append_options)."""
    spec = pipeline.spec
    if spec is None or spec.append_rows <= 0:
        return False
    options = dict(params.options)
    return all(options.get(k, v).lower() == v.lower() for k, v in spec.append_options.items())


def _parse(data: str) -> dict[str, Any]:
    """A text message as a JSON object (fatal otherwise); a lone surrogate is refused."""
    try:
        msg = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ProtocolError(f"a message is not valid JSON ({e}); send JSON objects", True) from None
    if not isinstance(msg, dict):
        raise ProtocolError('a message must be a JSON object such as {"type": "append", "text": "Hi"}', True)
    try:
        check_unicode(msg, "a message")
    except BodyError as e:
        raise ProtocolError(e.message, False) from None
    return msg


def add_routes(app: web.Application, pipeline: Pipeline, key: str | None) -> None:
    """The route, and a shutdown hook that closes the open sessions (before the pipeline fails
    their generations: build_app registers the pipeline's hook after this one)."""
    expected = key.encode() if key is not None else None
    sessions: set[Session] = set()

    async def close_sessions(app: web.Application) -> None:
        await asyncio.gather(*(s.going_away() for s in list(sessions)), return_exceptions=True)

    async def handle(request: web.Request) -> web.StreamResponse:
        sid, clash = pipeline.request_id(request)
        if clash:
            return openai_error(409, clash, {"X-Request-Id": sid})
        spec = pipeline.model_spec()
        if isinstance(spec, Failed):
            return openai_error(spec.status, spec.message, pipeline.spec_retry())
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=MAX_BODY_BYTES)
        if not ws.can_prepare(request).ok:
            return openai_error(
                400, f"{PATH} is a WebSocket endpoint: connect with Upgrade: websocket (see docs/api.md)"
            )
        await ws.prepare(request)
        session = Session(pipeline, request, ws, sid, expected)
        sessions.add(session)
        metrics = pipeline.metrics
        metrics.in_flight.labels("websocket").inc()
        outcome = "cancelled"
        try:
            outcome = await session.run()
        except (ClientGone, ConnectionError):  # gone, or closed while a frame was going out
            log.info("[%s] client disconnected", sid)
        finally:
            sessions.discard(session)
            session.close()
            if session.admitted:
                pipeline.admission.release()
            metrics.in_flight.labels("websocket").dec()
            metrics.finished("websocket", outcome)
        return ws

    app.router.add_get(PATH, handle)
    app.on_shutdown.append(close_sessions)
