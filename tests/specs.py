"""The served model's `ModelSpec` as a tokenizer worker announces it: for tests that play the
workers, or call the gateway's validation directly."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from common.ipc import Addresses, AsyncPushChannel
from common.messages import GatewayInMsg, ModelSpec
from programs import get_spec, load_program_class


@functools.cache
def model_spec(name: str) -> ModelSpec:
    """`name`'s spec, built by its weight-free program exactly as tokenizer_worker does."""
    return load_program_class(name)(get_spec(name), device="cpu").model_spec(name)


async def announce(app: Any, addresses: Addresses, model: str) -> None:
    """Announce `model`'s spec to the gateway `app` on its inbox, as a tokenizer worker does, until
    the gateway has it (for tests that run a gateway without tokenizer workers)."""
    from gateway.server import GATEWAY

    chan = AsyncPushChannel[GatewayInMsg](addresses.gateway_in, bind=False)
    try:
        deadline = time.monotonic() + 5
        while app[GATEWAY].spec is None:
            assert time.monotonic() < deadline, "the gateway never took the model's spec"
            await chan.send(model_spec(model))
            await asyncio.sleep(0.02)
    finally:
        chan.close()
