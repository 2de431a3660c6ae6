"""What a request's handler waits on: the events the inbox task routes to each request.

The inbox turns worker messages into four kinds of event on the request's queue: PCM bytes (one
audio chunk), `Done` (the workers finished or cancelled it), `Failed` (with the HTTP status to
answer) and `Sized` (the answer to a sizing request). Handlers never see wire structs, so the HTTP side does not change when a message does.
"""

from __future__ import annotations

import asyncio
import dataclasses

from common.messages import Finished, FinishReason


@dataclasses.dataclass(frozen=True)
class Done:
    """The workers finished the request (STOP / LENGTH) or cancelled it (ABORT)."""

    reason: FinishReason
    n_tokens: int = 0  # tokens generated, prompt excluded (all segments, once a synthesis ends)
    n_prompt_tokens: int = 0  # prompt tokens (all segments)

    @property
    def complete(self) -> bool:
        """The audio is all there (not cancelled)."""
        return self.reason in (FinishReason.STOP, FinishReason.LENGTH)


@dataclasses.dataclass(frozen=True)
class Failed:
    """The request failed; `status` is the HTTP status to answer with."""

    status: int
    message: str


@dataclasses.dataclass(frozen=True)
class Sized:
    """The prompt rows a request's model options add (a tokenizer worker's PromptSize)."""

    rows: int


Event = bytes | Done | Failed | Sized  # bytes: int16 little-endian PCM of one audio chunk


class ClientGone(Exception):
    """The HTTP client closed its connection."""


@dataclasses.dataclass
class Pending:
    """A request in flight: its events, and whether the workers are done with it."""

    queue: asyncio.Queue[Event] = dataclasses.field(default_factory=asyncio.Queue)
    ended_upstream: bool = False  # a Done/Failed came from the workers: no Abort needed


def finished_event(fin: Finished) -> Done | Failed:
    if fin.reason == FinishReason.ERROR:
        return Failed(error_status(fin.status or 500), fin.message or "the request failed in a worker")
    return Done(FinishReason(fin.reason), fin.n_tokens, fin.n_prompt_tokens)


def error_status(status: int) -> int:
    """Workers should send 4xx/5xx; anything else would confuse clients, so it becomes 500."""
    return status if 400 <= status <= 599 else 500
