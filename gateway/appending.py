"""The gateway's side of appended text (native input streaming, `gateway.native`): pieces of open
requests' input to the tokenizer pool, and their state rows to the gpu_worker holding each request.

Both hops carry one message per gateway tick, whatever the number of sessions: pieces and appends
collect while the event loop runs the handlers and go out together on its next turn (`AppendText`
to one tokenizer worker, one `Appends` per gpu_worker). While an `AppendText` waits for a free
tokenizer worker, the pieces that come after it collect here and follow as one message once a worker
has taken it: at most one waits in the pool's queue, however many ticks pass (a queue of urgent
messages would hold every prompt behind it). A tokenizer worker's answer
(`AppendedText`) is handed piece by piece to the session that asked (`listen`); the pieces a
tokenizer worker held when it died are tokenized again (`worker_died`: tokenizing is pure), and a
second answer for a piece is dropped. Appends for a
request whose prompt has not reached a gpu_worker yet wait here until it has (`routed`), so they
follow the prompt on that worker's socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from common.messages import Append, AppendedText, Appends, AppendText, TextPiece, TextRows
from common.pool import AsyncDispatchChannel

log = logging.getLogger(__name__)

Channel = Callable[[], "AsyncDispatchChannel[Any] | None"]


class TextRouter:
    """Batches pieces to tokenize and appends to deliver; `tokenizers` and `gpus` give the
    pipeline's dispatch channels (None before it starts)."""

    def __init__(self, tokenizers: Channel, gpus: Channel, submit_timeout_s: float) -> None:
        self._tokenizers, self._gpus = tokenizers, gpus
        self.submit_timeout_s = submit_timeout_s
        self._listeners: dict[str, Callable[[TextRows], None]] = {}
        self._pieces: list[TextPiece] = []
        self._asked: dict[tuple[str, int], tuple[TextPiece, str]] = {}  # (rid, seq) → piece, worker
        self._gpu_of: dict[str, bytes] = {}  # rid → the gpu_worker holding its prompt
        self._early: dict[str, list[Append]] = {}  # appends for prompts not yet on a gpu_worker
        self._appends: dict[bytes, list[Append]] = {}  # gpu_worker → appends of this tick
        self._flushing = False
        self._queued = False  # an AppendText waits for a free tokenizer worker
        self._tasks: set[asyncio.Task[None]] = set()

    # -- tokenizing ------------------------------------------------------------------------------

    def listen(self, rid: str, took: Callable[[TextRows], None]) -> None:
        """Hand `rid`'s tokenized pieces to `took` until `forget(rid)`."""
        self._listeners[rid] = took

    def tokenize(self, piece: TextPiece) -> None:
        self._asked[piece.rid, piece.seq] = (piece, "")
        self._pieces.append(piece)
        self._soon()

    def took(self, msg: AppendedText) -> None:
        for rows in msg.items:
            if self._asked.pop((rows.rid, rows.seq), None) is None:
                continue  # answered already (by a worker that died after answering)
            took = self._listeners.get(rows.rid)
            if took is not None:  # else the session moved on (a clear, its end): late news
                took(rows)

    def worker_died(self, name: str) -> None:
        """Tokenize again the pieces the tokenizer worker `name` held."""
        for key, (piece, holder) in list(self._asked.items()):
            if holder == name:
                del self._asked[key]
                if piece.rid in self._listeners:
                    log.warning("[%s] %s stopped while tokenizing its text; again", piece.rid, name)
                    self.tokenize(piece)

    async def _send_pieces(self, pieces: list[TextPiece]) -> None:
        chan = self._tokenizers()
        try:
            if chan is None:
                raise ConnectionError("the gateway is not started")
            ident = await asyncio.wait_for(chan.send(AppendText(pieces), urgent=True), self.submit_timeout_s)
            name = chan.workers.get(ident, "")
            for p in pieces:
                if (p.rid, p.seq) in self._asked:
                    self._asked[p.rid, p.seq] = (p, name)
        except (asyncio.TimeoutError, ConnectionError) as e:
            why = f"no tokenizer worker took the text within {self.submit_timeout_s:g} s; see /ready"
            log.warning("appended text not tokenized: %s", e or why)
            self.took(AppendedText([TextRows(p.rid, p.seq, error=why, status=503) for p in pieces]))
        finally:
            self._queued = False
            if self._pieces:  # what came while it waited: the next message
                self._soon()

    # -- appending -------------------------------------------------------------------------------

    def append(self, item: Append) -> None:
        """Deliver `item` to the gpu_worker holding its request (once its prompt is there)."""
        if item.rid not in self._listeners:
            return  # the session moved on (a clear, its end): the request is aborted
        ident = self._gpu_of.get(item.rid)
        if ident is None:
            self._early.setdefault(item.rid, []).append(item)
            return
        self._appends.setdefault(ident, []).append(item)
        self._soon()

    def routed(self, rid: str, ident: bytes) -> None:
        """`rid`'s prompt went to the gpu_worker `ident`: its appends go there from now on."""
        if rid not in self._listeners:
            return
        self._gpu_of[rid] = ident
        for item in self._early.pop(rid, []):
            self.append(item)

    def forget(self, rid: str) -> None:
        self._listeners.pop(rid, None)
        self._gpu_of.pop(rid, None)
        self._early.pop(rid, None)
        for key in [k for k in self._asked if k[0] == rid]:  # one piece at a time per session
            del self._asked[key]

    # -- one message per tick --------------------------------------------------------------------

    def _soon(self) -> None:
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        if self._pieces and not self._queued:
            pieces, self._pieces, self._queued = self._pieces, [], True
            task = asyncio.create_task(self._send_pieces(pieces))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        appends, self._appends = self._appends, {}
        gpus = self._gpus()
        for ident, items in appends.items():
            # A gpu_worker gone before it took them: the pipeline fails its requests (it saw it die).
            if gpus is None or not gpus.send_to(ident, Appends(items)):
                log.warning("could not deliver %d appends to a gpu_worker that is gone", len(items))
