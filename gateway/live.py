"""A WebSocket session's speech: its segments as generations, their audio played in order.

Segment k of a session (k counts from 0 over the whole session, clears included) is one
`GenerateRequest` with rid `<session id>/<k>` and seed `seed + k`, as the segments of a long HTTP
text are (`gateway.synthesis`). Unlike those, a segment is submitted as soon as its text is known
while at most `AHEAD` segments wait ahead of the one playing, so the next one is prefilled and
generating before the one playing ends; its audio waits in its own queue until every earlier
segment has been sent. A segment submitted while audio is already playing is urgent: it goes ahead
of new requests in the tokenizer pool and the gpu_worker's admission.

The audio is joined by a `Joiner`: every segment but the first (of the session, or after a clear)
fades in over FADE_S, and every segment fades out over its last FADE_S (the gateway cannot know
whether more text follows), so the audio never depends on when the client's messages came.

`clear()` (barge-in) and `close()` abort every generation of the session upstream, as an HTTP
request's are when its client goes away: no KV pages stay held.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from common.messages import FinishReason, GenerateRequest
from gateway.events import Done, Failed, Pending
from gateway.incremental import SessionParams
from gateway.pipeline import PART_SEP, Pipeline
from gateway.segments import FADE_S, Joiner
from gateway.validation import SEED_MAX

AHEAD = 1  # segments generating ahead of the one playing

SendAudio = Callable[[bytes], Awaitable[None]]
SendEvent = Callable[[dict[str, Any]], Awaitable[None]]


@dataclasses.dataclass
class Segment:
    """One segment of the session's text and its generation."""

    index: int
    text: str
    rid: str
    pending: Pending | None = None  # set once submitted
    n_samples: int = 0  # sent so far


class LiveSynthesis:
    """The session's segments in order: `add` queues text, `play` sends their audio."""

    def __init__(
        self,
        pipeline: Pipeline,
        request: web.Request,
        sid: str,
        params: SessionParams,
        send_audio: SendAudio,
        send_event: SendEvent,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.sid = sid
        self.params = params
        self.send_audio = send_audio
        self.send_event = send_event
        self.segments: collections.deque[Segment] = collections.deque()  # not yet fully sent
        self.next_index = 0
        self.ended = False  # the client sent `end`
        # Set by `stop` before `play`'s task is cancelled: Python 3.11's wait_for may swallow a
        # cancellation that meets a ready event, so `play` also looks at this before each step.
        self.stopped = False
        self.n_samples = 0  # sent over the session
        self.n_tokens = 0
        self.n_prompt_tokens = 0
        self.quiet_since = time.monotonic()  # when the session last had nothing to generate or send
        self._joiner = Joiner(round(FADE_S * pipeline.sample_rate))
        self._playing = False  # audio of the current utterance went out (until a clear)
        self.first_text: float | None = None  # monotonic time of the utterance's first append
        self._joining = -1  # the segment the joiner is on
        self._reason = FinishReason.STOP  # the last segment's finish reason
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def busy(self) -> bool:
        """Something is generating or waiting to be sent."""
        return bool(self.segments)

    def add(self, texts: list[str]) -> None:
        """Queue segments; those within AHEAD of the one playing are submitted at once."""
        for text in texts:
            k = self.next_index
            self.next_index += 1
            self.segments.append(Segment(k, text, f"{self.sid}{PART_SEP}{k}"))
        self._submit_due()
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    def stop(self) -> None:
        """Make `play` return (None) at its next step; the caller cancels its task too."""
        self.stopped = True
        self._changed.set()

    async def play(self) -> Done | Failed | None:
        """Send each segment's audio in order until the input has ended and all of it is sent
        (Done with the session's token counts), or the first failure; None once stopped."""
        while not self.stopped:
            if not self.segments:
                if self.ended:
                    return Done(self._reason, self.n_tokens, self.n_prompt_tokens)
                self._changed.clear()
                await self._changed.wait()
                continue
            seg = self.segments[0]
            assert seg.pending is not None, "the first segment is always submitted"
            if self._joining != seg.index:
                self._joining = seg.index
                self._joiner.start(last=False)  # whether more text follows is unknown: fade it out
            event = await self.pipeline.next_event(self.request, seg.pending)
            if self.stopped:
                break
            if isinstance(event, bytes):
                await self._audio(seg, self._joiner.feed(event))
                continue
            if isinstance(event, Failed):
                return event
            if not event.complete:
                return Failed(503, "the workers cancelled a segment of this session; retry")
            self._reason = event.reason
            self.n_tokens += event.n_tokens
            self.n_prompt_tokens += event.n_prompt_tokens
            await self._audio(seg, self._joiner.end())
            self.segments.popleft()
            self.pipeline.release(seg.rid)
            self.quiet_since = time.monotonic()
            self._submit_due()
            seconds = round(seg.n_samples / self.pipeline.sample_rate, 4)
            await self.send_event(
                {"type": "segment.done", "index": seg.index, "text": seg.text, "audio_seconds": seconds}
            )
        return None

    def clear(self) -> int:
        """Abort and forget every segment (the caller has stopped `play` first); returns how many."""
        n = len(self.segments)
        self._abort_all()
        self.stopped = False
        self.quiet_since = time.monotonic()
        self._joiner = Joiner(self._joiner.fade)
        self._joining = -1
        self._playing = False
        self.first_text = None
        return n

    def close(self) -> None:
        """Abort every generation still held upstream (the session is over, for any reason)."""
        self._abort_all()
        for task in self._tasks:
            task.cancel()

    # -- internals --------------------------------------------------------------------------------

    def _submit_due(self) -> None:
        for seg in list(self.segments)[: 1 + AHEAD]:
            if seg.pending is None:
                self._submit(seg)

    def _submit(self, seg: Segment) -> None:
        seg.pending = self.pipeline.register(seg.rid)
        if self.pipeline.closing:
            seg.pending.queue.put_nowait(Failed(503, "the gateway is shutting down; retry"))
            return
        sampling = self.params.sampling
        req = GenerateRequest(
            rid=seg.rid,
            text=seg.text,
            sampling=msgspec.structs.replace(sampling, seed=(sampling.seed + seg.index) % (SEED_MAX + 1)),
            model_kwargs={"voice": self.params.voice, **dict(self.params.options)},
            arrival=time.time(),
            urgent=self._playing,  # the listener is already hearing this session
        )
        task = asyncio.create_task(self._send(req, seg.pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, req: GenerateRequest, pending: Pending) -> None:
        failed = await self.pipeline.submit(req)
        if failed is not None:
            pending.queue.put_nowait(failed)

    async def _audio(self, seg: Segment, pcm: bytes) -> None:
        if not pcm:
            return
        if not self._playing:
            self._playing = True
            if self.first_text is not None:
                self.pipeline.metrics.text_to_first_audio.observe(time.monotonic() - self.first_text)
            await self.send_event({"type": "audio.started", "index": seg.index})
        seg.n_samples += len(pcm) // 2
        self.n_samples += len(pcm) // 2
        await self.send_audio(pcm)

    def _abort_all(self) -> None:
        upstream = []
        while self.segments:
            seg = self.segments.popleft()
            if seg.pending is None:
                continue
            self.pipeline.release(seg.rid)
            if not seg.pending.ended_upstream:
                upstream.append(seg.rid)
        if upstream:
            self.pipeline.abort(upstream)
