"""Appended text in the gpu_worker (native input streaming, programs/base.py "Appended text").

A request opened with `Prompt.open_input` takes `Appends` while it runs: the items that came since
the last step go into the request's slot before the next one, as one write (the program's `extend`,
host side, graph-safe), or, while it still waits for a slot, join the state its admission writes.
Its input stays open until an item with `end`; while open, the scheduler leaves it out of every step it has no text for
(`Scheduler.waits`), and it resumes, where it was, as soon as rows arrive. Once its input has ended
it runs as a request whose whole text came with its prompt: same state, same steps, same tokens.

Rows past the program's `append_capacity` end the request with a 400 that says so; an append for
a request this worker does not hold (finished, aborted, never here) is dropped: its gateway has
already been told how it ended.
"""

from __future__ import annotations

import logging

import numpy as np

from common.arrays import np_array
from common.messages import Append, Appends, FinishReason
from gpu_worker.scheduler.request import Request
from gpu_worker.scheduler.scheduler import Scheduler
from programs.base import LMProgram

log = logging.getLogger(__name__)


class HeldAppends:
    """Appends off the inbox, written at the next step: all of a request's items since the last
    step become one write into its slot (`LMProgram.extend` copies to the device on every call, and
    100 sessions appending a word every 10 ms send thousands of items a second)."""

    def __init__(self) -> None:
        self._items: dict[str, list[Append]] = {}  # rid → its items, in arrival order

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, msg: Appends) -> None:
        for item in msg.items:
            self._items.setdefault(item.rid, []).append(item)

    def write(self, scheduler: Scheduler) -> list[Request]:
        """Every held item into its request's state (an Abort since then drops its request's) → the
        requests whose slot it wrote into (on the current stream, ahead of the next step)."""
        held, self._items = self._items, {}
        written = [take_appends(scheduler, rid, items) for rid, items in held.items()]
        return [r for r in written if r is not None]


def take_appends(scheduler: Scheduler, rid: str, items: list[Append]) -> Request | None:
    """`rid`'s items, in order, into its state as one write; the first that cannot be taken ends the
    request (nothing of them written) → the request if its slot was written into."""
    req = scheduler.running.get(rid) or next((r for r in scheduler.waiting if r.rid == rid), None)
    if req is None or req.done:
        log.debug("[%s] dropped %d appends for a request not held here", rid, len(items))
        return None
    parts: dict[str, list[np.ndarray]] = {}
    n, open_ = 0, req.input_open
    for item in items:
        state, why = _checked(scheduler.program, req, item, open_, req.n_text + n)
        if why:
            fail(scheduler, req, why)
            return None
        for name, a in state.items():
            parts.setdefault(name, []).append(a)
        n += item.n_rows
        open_ = open_ and not item.end
    written = None
    if n:
        state = {name: np.concatenate(a) if len(a) > 1 else a[0] for name, a in parts.items()}
        if req.slot >= 0:
            scheduler.program.extend(req.slot, state, req.n_text)
            written = req
        else:  # admission writes the whole state into the slot
            merged = dict(req.state)
            for name, a in state.items():
                merged[name] = np.concatenate([merged[name], a]) if name in merged else a
            req.state = merged
        req.n_text += n
    req.input_open = open_
    return written


def _checked(
    program: LMProgram, req: Request, item: Append, open_: bool, n_text: int
) -> tuple[dict[str, np.ndarray], str]:
    """One item's state rows, and "" or why they cannot be taken (`n_text`: the request's rows
    before them; `open_`: whether its input is still open then)."""
    if not open_:
        return {}, "an append after the request's input ended"
    try:
        state = {name: np_array(a) for name, a in item.state.items()}
    except ValueError as e:
        return {}, f"an append's state is not what it says: {e}"
    why = program.check_append(state) if state else ""
    if why:
        return {}, f"bad append: {why}"
    k = program.appended_rows(state)
    if k != item.n_rows:
        return {}, f"an append says {item.n_rows} rows and holds {k}"
    if n_text + k > program.append_capacity:
        return {}, (
            f"the text is {n_text + k} tokens, more than one generation holds "
            f"({program.append_capacity}); end the input sooner and speak the rest in another"
        )
    return (state if k else {}), ""


def fail(scheduler: Scheduler, req: Request, message: str) -> None:
    """End `req` with a 400 that says why (its slot and pages back at once)."""
    waiting = [r for r in scheduler.waiting if r is not req]  # (identity: requests hold arrays)
    if len(waiting) < len(scheduler.waiting):
        scheduler.waiting.clear()
        scheduler.waiting.extend(waiting)
    scheduler.finish(req, FinishReason.ERROR)
    scheduler.finished[-1].message, scheduler.finished[-1].status = message, 400
