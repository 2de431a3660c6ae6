"""A WebSocket session's speech by native input streaming, for a model that takes text appended to
a running generation (ModelSpec.append_rows > 0, in the mode its `append_options` set).

An utterance is one generation (rid `<session id>/<k>`, seed `seed + k`; k counts the utterances,
clears included) opened once its first words are tokenized and fed the rest as it comes:

1. the client's text collects in a buffer; one piece at a time goes to the tokenizer pool
   (`TextPiece`: the text held back last time and what came since), which answers with the state
   rows of the part whose tokens are final and the text it held back (the last word may go on);
2. the first rows' text opens the generation (`GenerateRequest.open_input`: the program's prompt
   of that text); the later rows go to the gpu_worker holding it (`Append`), the last with `end`;
3. the gpu_worker speaks each text id as it reaches it and waits, out of the batch, while the text
   runs out; its audio passes through untouched.

So the audio of a text equals that of the same text sent whole in the streaming text mode with the
same seed, however it was cut into appends. `flush` holds nothing back from the piece it sends (a
word cut by it is spoken as cut); `end` ends the input; a text longer than one generation holds
(append_rows) ends the session with an error. `clear` aborts the generation upstream (its slot and
KV pages are free within a step) and starts the next utterance.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from aiohttp import web

from common.messages import Append, FinishReason, GenerateRequest, TextPiece, TextRows
from gateway.events import Done, Failed, error_status
from gateway.incremental import SessionParams
from gateway.live import SendAudio, SendEvent
from gateway.pipeline import PART_SEP, Pipeline
from gateway.validation import SEED_MAX


class NativeSynthesis:
    """The session's utterances, one generation each: `append`/`flush`/`end` feed it, `play` sends
    its audio. The same methods and counters as `gateway.live.LiveSynthesis`."""

    def __init__(
        self,
        pipeline: Pipeline,
        request: web.Request,
        sid: str,
        params: SessionParams,
        send_audio: SendAudio,
        send_event: SendEvent,
    ) -> None:
        self.pipeline, self.request, self.sid, self.params = pipeline, request, sid, params
        self.send_audio, self.send_event = send_audio, send_event
        spec = pipeline.spec
        assert spec is not None and spec.append_rows > 0, "a model that takes appended text"
        self.capacity = spec.append_rows
        self.append_options = dict(spec.append_options)  # the model options of its appending mode
        self.next_index = 0  # generations opened (the usage's segments)
        self._k = 0  # utterances started, clears included
        self.ended = False  # the client sent `end`
        self.stopped = False  # see LiveSynthesis.stopped
        self.n_samples = self.n_tokens = self.n_prompt_tokens = 0
        self.quiet_since = time.monotonic()  # the last text or audio
        self.first_text: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._start()

    def _start(self) -> None:
        """A fresh utterance: its rid registered, nothing buffered, nothing open."""
        self.index = self._k
        self._k += 1
        self.rid = f"{self.sid}{PART_SEP}{self.index}"
        self.pending = self.pipeline.register(self.rid)
        self.pipeline.appends.listen(self.rid, self._took)
        self._buffer = ""  # text not yet sent to the tokenizer (what it held back first)
        self._fresh = False  # the buffer holds text the tokenizer has not seen yet
        self._seq = 0
        self._asking = False  # a piece is with the tokenizer pool
        self._flush = False
        self._last_sent = False  # the input's last piece went to the tokenizer pool
        self._opening = ""  # taken text before the generation opens
        self._text = ""  # the taken text, all of it
        self._opened = self._finished = self._playing = False
        self._failed_here = False  # the gateway ended it (a refused text): the workers may hold it
        self._upstream_over = False  # the workers ended it: nothing to abort
        self._rows = 0

    @property
    def busy(self) -> bool:
        """The input has ended and the rest is being spoken (a silent client is not idle then)."""
        return self.ended and not self._finished

    # -- the client's messages ----------------------------------------------------------------------

    def append(self, text: str) -> None:
        self._buffer += text
        self._fresh = self._fresh or bool(text)
        self.quiet_since = time.monotonic()
        if self.first_text is None and text.strip():
            self.first_text = self.quiet_since
        self._ask()

    def flush(self) -> None:
        self._flush = True
        self._ask()

    def end(self) -> None:
        self.ended = True
        self._ask()

    def stop(self) -> None:
        """Make `play` return (None) at its next step; the caller cancels its task too."""
        self.stopped = True
        self.pending.queue.put_nowait(Failed(499, "stopped"))  # wakes `play` if it waits

    def clear(self) -> int:
        """Abort the utterance (the caller has stopped `play`), start the next; returns 1 if there
        was one to abort."""
        had = int(self._opened and not self._finished)
        self._abort()
        self.stopped = False
        self.quiet_since = time.monotonic()
        self.first_text = None
        self._start()
        if self.ended:  # a clear after `end`: nothing more to speak, the session is done
            self._ask()
        return had

    def close(self) -> None:
        self._abort()
        for task in self._tasks:
            task.cancel()

    # -- tokenizing and appending -----------------------------------------------------------------

    def _ask(self) -> None:
        """Send the buffered text to the tokenizer pool, unless a piece is already there (its
        held-back text must come back first), the input's last piece has gone, or nothing came
        since the last piece: text held back alone is held back again (its last word may go on),
        so it waits for more text, a flush or the end."""
        if self._asking or self._last_sent or self.stopped:
            return
        final = self.ended or self._flush
        if not self._fresh and not final:
            return
        piece = TextPiece(self.rid, self._seq, self._buffer, final)
        self._seq += 1
        self._buffer, self._asking, self._flush, self._last_sent = "", True, False, self.ended
        self._fresh = False
        self.pipeline.appends.tokenize(piece)

    def _took(self, rows: TextRows) -> None:
        """A piece's rows: open the generation with them, or append them to it."""
        self._asking = False
        if rows.error:
            self._fail(Failed(error_status(rows.status), rows.error))
            return
        self._buffer = rows.held + self._buffer
        self._rows += rows.n_rows
        if self._rows > self.capacity:
            self._fail(
                Failed(
                    400,
                    f"the text is {self._rows} tokens; one generation holds at most {self.capacity}: "
                    "end the input sooner (open another session for the rest)",
                )
            )
            return
        last = self._last_sent  # this was the input's last piece
        self._text += rows.taken
        if not self._opened:
            self._opening += rows.taken
            if self._opening.strip():
                self._open(ended=last)
            elif last:  # the input ended with nothing to speak
                self.pending.queue.put_nowait(Done(FinishReason.STOP))
        elif rows.n_rows or last:
            self.pipeline.appends.append(Append(self.rid, rows.state, rows.n_rows, last))
        self._ask()

    def _open(self, ended: bool) -> None:
        self._opened = True
        self.next_index += 1
        sampling = self.params.sampling
        req = GenerateRequest(
            rid=self.rid,
            text=self._opening,
            sampling=msgspec.structs.replace(sampling, seed=(sampling.seed + self.index) % (SEED_MAX + 1)),
            model_kwargs={"voice": self.params.voice, **dict(self.params.options), **self.append_options},
            arrival=time.time(),
            open_input=not ended,
        )
        task = asyncio.create_task(self._submit(req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit(self, req: GenerateRequest) -> None:
        failed = await self.pipeline.submit(req)
        if failed is not None:
            self._failed_here = True  # it may have got through: abort it at the end
            self.pending.queue.put_nowait(failed)

    def _fail(self, failed: Failed) -> None:
        self._last_sent = self._failed_here = True  # nothing more goes upstream
        self.pending.queue.put_nowait(failed)

    def _abort(self) -> None:
        """Forget the utterance; abort its generation unless the workers ended it (a generation
        waiting for text would hold its slot and pages for good)."""
        self.pipeline.release(self.rid)
        if self._opened and not self._upstream_over:
            self.pipeline.abort([self.rid])
        self._finished = self._upstream_over = True

    # -- the audio ----------------------------------------------------------------------------------

    async def play(self) -> Done | Failed | None:
        """Send the utterance's audio until it ends: Done with its token counts once its input has
        ended and it is all sent, the first failure, or None once stopped."""
        while not self.stopped:
            event = await self.pipeline.next_event(self.request, self.pending)
            if self.stopped:
                break
            if isinstance(event, bytes):
                await self._audio(event)
                continue
            if isinstance(event, Failed):
                if event.status == 504 and not self.ended:
                    continue  # waiting for text: the client's silence is the session's idle timeout
                self._finished = True
                self._upstream_over = event.status != 504 and not self._failed_here
                return event
            self._finished = self._upstream_over = True
            if not isinstance(event, Done) or not event.complete:
                return Failed(503, "the workers cancelled this session's generation; retry")
            self.n_tokens += event.n_tokens
            self.n_prompt_tokens += event.n_prompt_tokens
            if self._opened:
                seconds = round(self.n_samples / self.pipeline.sample_rate, 4)
                await self.send_event(
                    {
                        "type": "segment.done",
                        "index": self.index,
                        "text": self._text,
                        "audio_seconds": seconds,
                    }
                )
            return Done(event.reason, self.n_tokens, self.n_prompt_tokens)
        return None

    async def _audio(self, pcm: bytes) -> None:
        if not pcm:
            return
        self.quiet_since = time.monotonic()
        if not self._playing:
            self._playing = True
            if self.first_text is not None:
                self.pipeline.metrics.text_to_first_audio.observe(self.quiet_since - self.first_text)
            await self.send_event({"type": "audio.started", "index": self.index})
        self.n_samples += len(pcm) // 2
        await self.send_audio(pcm)
