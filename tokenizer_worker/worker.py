"""A tokenizer_worker process: builds prompts on a weight-free program.

Any number of these pull GenerateRequests from the gateway's PUSH socket. A request the program
rejects (ValueError) gets a 400 RequestError with the program's message; anything else a 500, and
the worker keeps serving.
"""

from __future__ import annotations

import logging

import numpy as np

from common.config import ServeConfig, program_kwargs
from common.ipc import PullChannel, PushChannel
from common.messages import GatewayInMsg, GenerateRequest, GpuInMsg, ProcState, Prompt, RequestError
from common.proc import StatusReporter
from programs import get_spec, load_program_class
from programs.base import LMProgram

log = logging.getLogger(__name__)


class PromptBuilder:
    """GenerateRequest → Prompt, or RequestError (no sockets: testable alone)."""

    def __init__(self, program: LMProgram, max_context: int) -> None:
        self.program = program
        self.max_context = max_context

    def build(self, req: GenerateRequest) -> Prompt | RequestError:
        try:
            rows = np.ascontiguousarray(self.program.preprocess(req.text, req.model_kwargs), dtype="<i4")
        except ValueError as e:
            return RequestError(req.rid, 400, str(e))
        except Exception as e:
            log.exception("preprocess failed for %s", req.rid)
            return RequestError(req.rid, 500, f"prompt builder error: {type(e).__name__}: {e}")
        budget = min(req.sampling.max_tokens, self.max_context)
        if len(rows) >= budget:
            return RequestError(
                req.rid,
                400,
                f"the prompt is {len(rows)} tokens but max_tokens (which counts the prompt) allows "
                f"{budget}: shorten the text or raise max_tokens",
            )
        return Prompt(req.rid, rows.tobytes(), len(rows), req.sampling, req.arrival)


class TokenizerWorker:
    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(spec, device="cpu", **program_kwargs(cfg))
        status.set(ProcState.LOADING, "loading the text tokenizer")
        program.preprocess("warm up", {})  # loads the tokenizer now rather than on the first request
        self.builder = PromptBuilder(program, min(cfg.max_context or spec["max_tokens"], spec["max_tokens"]))
        self.inbox: PullChannel[GenerateRequest] = PullChannel(
            cfg.addresses.requests, GenerateRequest, bind=False
        )
        self.to_gpu: PushChannel[GpuInMsg] = PushChannel(cfg.addresses.gpu_in)
        self.to_gateway: PushChannel[GatewayInMsg] = PushChannel(cfg.addresses.gateway_in)

    def run(self) -> None:
        while True:
            req = self.inbox.recv()
            if req is None:
                continue
            out = self.builder.build(req)
            if isinstance(out, Prompt):
                self.to_gpu.send(out)
            else:
                self.to_gateway.send(out)
