"""Appended text in the gpu_worker (native input streaming, programs/base.py "Appended text").

A request opened with `Prompt.open_input` takes `Appends` while it runs: each item's state rows go
into the request's slot between steps (the program's `extend`, host side, graph-safe), or, while
it still waits for a slot, join the state its admission writes. Its input stays open until an
item with `end`; while open, the scheduler leaves it out of every step it has no text for
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


def take_appends(scheduler: Scheduler, msg: Appends) -> None:
    """Every item of `msg`, in order, into its request's state."""
    for item in msg.items:
        req = scheduler.running.get(item.rid) or next(
            (r for r in scheduler.waiting if r.rid == item.rid), None
        )
        if req is None or req.done:
            log.debug("[%s] dropped an append for a request not held here", item.rid)
            continue
        why = _append(scheduler.program, req, item)
        if why:
            fail(scheduler, req, why)


def _append(program: LMProgram, req: Request, item: Append) -> str:
    """Write one item into `req`'s state; "" or why it cannot be taken."""
    if not req.input_open:
        return "an append after the request's input ended"
    try:
        state = {name: np_array(a) for name, a in item.state.items()}
    except ValueError as e:
        return f"an append's state is not what it says: {e}"
    why = program.check_append(state) if state else ""
    if why:
        return f"bad append: {why}"
    k = program.appended_rows(state)
    if k != item.n_rows:
        return f"an append says {item.n_rows} rows and holds {k}"
    if req.n_text + k > program.append_capacity:
        return (
            f"the text is {req.n_text + k} tokens, more than one generation holds "
            f"({program.append_capacity}); end the input sooner and speak the rest in another"
        )
    if k:
        if req.slot >= 0:
            program.extend(req.slot, state, req.n_text)
        else:  # admission writes the whole state into the slot
            merged = dict(req.state)
            for name, a in state.items():
                merged[name] = np.concatenate([merged[name], a]) if name in merged else a
            req.state = merged
        req.n_text += k
    if item.end:
        req.input_open = False
    return ""


def fail(scheduler: Scheduler, req: Request, message: str) -> None:
    """End `req` with a 400 that says why (its slot and pages back at once)."""
    waiting = [r for r in scheduler.waiting if r is not req]  # (identity: requests hold arrays)
    if len(waiting) < len(scheduler.waiting):
        scheduler.waiting.clear()
        scheduler.waiting.extend(waiting)
    scheduler.finish(req, FinishReason.ERROR)
    scheduler.finished[-1].message, scheduler.finished[-1].status = message, 400
