"""A tokenizer_worker process: builds prompts on a weight-free program, and announces the model.

It is the process that announces the served model's `ModelSpec` to the gateway: it holds the
model's program without weights (so it is ready within seconds, long before a gpu_worker has loaded
its weights), it is the one that evaluates the program's prompt hooks, and the gateway cannot serve
a request without one anyway. It sends the spec once it is ready and every `SPEC_EVERY_S` after, so
a gateway that restarts learns it again.

Any number of these take GenerateRequests (and the text appended to open requests, `AppendText`:
the program's `take_text` and `append`) from the gateway's dispatcher, one at a time and only
when free (`common.pool`), so they can join and leave while serving. Built prompts go back to the
gateway, which hands each to a gpu_worker with free capacity. On SIGTERM a worker stops
asking for work, finishes what was already on its way, and exits. A request the program rejects
(ValueError) gets a 400 RequestError with the program's message; anything else a 500, and the
worker keeps serving.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from common.arrays import np_array, wire_array
from common.config import ServeConfig, program_kwargs
from common.ipc import PushChannel
from common.messages import (
    AppendedText,
    AppendText,
    GatewayInMsg,
    GenerateRequest,
    ModelSpec,
    ProcState,
    Prompt,
    PromptSize,
    RequestError,
    TextPiece,
    TextRows,
    TokenizerInMsg,
    VoiceFeatures,
)
from common.pool import WorkChannel
from common.proc import StatusReporter
from programs import get_spec, load_program_class, served_name
from programs.base import LMProgram, PromptRows, Voice

log = logging.getLogger(__name__)

SPEC_EVERY_S = 1.0  # how often the model's spec is announced again (a restarted gateway waits this long)


__all__ = ["PromptBuilder", "TokenizerWorker", "program_voice", "wire_array", "wire_prompt"]


def program_voice(voice: VoiceFeatures | None) -> Voice | None:
    """A request's cloned voice as the program takes it. Raises ValueError for arrays that are not
    what they say."""
    if voice is None:
        return None
    return Voice({name: np_array(a) for name, a in voice.features.items()}, voice.text)


def wire_prompt(built: np.ndarray | PromptRows) -> tuple[np.ndarray, dict]:
    """What a program's `preprocess` returned → (rows as little-endian int32, contiguous; the
    per-request state as wire arrays), as a Prompt carries them."""
    built = built if isinstance(built, PromptRows) else PromptRows(built)
    rows = np.ascontiguousarray(built.rows, dtype="<i4")
    return rows, {name: wire_array(a) for name, a in built.state.items()}


class PromptBuilder:
    """GenerateRequest → Prompt (or PromptSize when it asks only for that), or RequestError (no
    sockets: testable alone)."""

    def __init__(self, program: LMProgram, max_context: int) -> None:
        self.program = program
        self.max_context = max_context

    def build(self, req: GenerateRequest) -> Prompt | PromptSize | RequestError:
        if req.size_only:
            return self.size(req)
        try:
            voice = program_voice(req.voice)
            if voice is None:  # a program without cloning keeps its two-argument preprocess
                built = self.program.preprocess(req.text, req.model_kwargs)
            else:
                built = self.program.preprocess(req.text, req.model_kwargs, voice=voice)
            rows, state = wire_prompt(built)
        except ValueError as e:
            return RequestError(req.rid, 400, str(e))
        except Exception as e:
            log.exception("preprocess failed for %s", req.rid)
            return RequestError(req.rid, 500, f"prompt builder error: {type(e).__name__}: {e}")
        bad = self._shape_error(rows)
        if bad:
            log.error("[%s] the program built a bad prompt: %s", req.rid, bad)
            return RequestError(req.rid, 500, f"prompt builder error: {bad}")
        budget = min(req.sampling.max_tokens, self.max_context)
        if len(rows) >= budget:
            return RequestError(
                req.rid,
                400,
                f"the prompt is {len(rows)} tokens but max_tokens (which counts the prompt) allows "
                f"{budget}: shorten the text or raise max_tokens",
            )
        return Prompt(
            req.rid, rows.tobytes(), len(rows), req.sampling, req.arrival, req.urgent, state, req.open_input
        )

    def append(self, msg: AppendText) -> AppendedText:
        """Each piece of open requests' input as state rows (the program's `take_text` and
        `append`), or why the program refused it (400: ValueError, 500: anything else)."""
        return AppendedText([self._piece(p) for p in msg.pieces])

    def _piece(self, piece: TextPiece) -> TextRows:
        program = self.program
        if not program.appends_text:
            return TextRows(piece.rid, piece.seq, error=f"{program.name} takes no appended text", status=400)
        try:
            taken, held = program.take_text(piece.text, piece.final)
            state = program.append(taken) if taken else {}
            n = program.appended_rows(state)
            wire = {name: wire_array(a) for name, a in state.items()}
        except ValueError as e:
            return TextRows(piece.rid, piece.seq, error=str(e), status=400)
        except Exception as e:
            log.exception("append failed for %s", piece.rid)
            return TextRows(
                piece.rid, piece.seq, error=f"prompt builder error: {type(e).__name__}: {e}", status=500
            )
        return TextRows(piece.rid, piece.seq, wire, n, taken, held)

    def size(self, req: GenerateRequest) -> PromptSize | RequestError:
        """The prompt rows `req`'s model options add (the program's `option_rows`)."""
        try:
            voice = program_voice(req.voice)
            if voice is None:
                return PromptSize(req.rid, int(self.program.option_rows(req.model_kwargs)))
            return PromptSize(req.rid, int(self.program.option_rows(req.model_kwargs, voice=voice)))
        except ValueError as e:
            return RequestError(req.rid, 400, str(e))
        except Exception as e:
            log.exception("option_rows failed for %s", req.rid)
            return RequestError(req.rid, 500, f"prompt builder error: {type(e).__name__}: {e}")

    def _shape_error(self, rows: np.ndarray) -> str:
        """Why `rows` is not a prompt the gpu_worker can run ("" when it is): the program contract's
        [R, C] rows of ids in [0, input_vocab_size) (programs/base.py). The one full check of a
        prompt; later hops check only that the bytes they got are R rows of C ids."""
        c = self.program.n_codebooks
        if rows.ndim != 2 or rows.shape[1] != c or not len(rows):
            return f"rows of shape {list(rows.shape)}, not [R, {c}] with R > 0"
        if rows.min() < 0 or rows.max() >= self.program.input_vocab_size:
            return f"ids outside [0, {self.program.input_vocab_size})"
        return ""


def _test_delay() -> tuple[str, float] | None:
    """Test-only hook: VOXPIPE_TEST_PROMPT_DELAY="PREFIX=SECONDS" makes prompts whose text starts
    with PREFIX take SECONDS longer (how the pool tests make a slow prompt)."""
    spec = os.environ.get("VOXPIPE_TEST_PROMPT_DELAY", "")
    if not spec:
        return None
    prefix, _, seconds = spec.rpartition("=")
    return prefix, float(seconds)


class TokenizerWorker:
    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(spec, device="cpu", **program_kwargs(cfg))
        status.set(ProcState.LOADING, "loading the text tokenizer")
        program.load_prompts()  # the text tokenizer now rather than at the first request
        self.builder = PromptBuilder(
            program, min(cfg.gpu.max_context or spec["max_tokens"], spec["max_tokens"])
        )
        self.spec: ModelSpec = program.model_spec(served_name(cfg.model))
        self.status = status
        self.inbox: WorkChannel[TokenizerInMsg] = WorkChannel(
            cfg.addresses.requests, TokenizerInMsg, name=status.name
        )
        self.to_gateway: PushChannel[GatewayInMsg] = PushChannel(cfg.addresses.gateway_in)
        self._stopping = False
        self._delay = _test_delay()
        self._spec_sent = -float("inf")  # time.monotonic() of the last announcement

    def stop(self) -> None:
        """From a signal handler: finish the current prompt, then leave the pool."""
        self._stopping = True

    def run(self) -> None:
        while not self._stopping:
            if time.monotonic() - self._spec_sent >= SPEC_EVERY_S:
                self.to_gateway.send(self.spec)
                self._spec_sent = time.monotonic()
            req = self.inbox.recv(timeout_ms=100)
            if req is not None:
                self.handle(req)
        handed = self.inbox.leave()  # what the dispatcher sent before it saw us leave: finish it
        for req in handed:
            self.handle(req)
        log.info("left the pool (%d prompts finished after the stop)", len(handed))
        self.inbox.close()

    def handle(self, req: TokenizerInMsg) -> None:
        if isinstance(req, AppendText):
            self.to_gateway.send(self.builder.append(req))
            return
        self.status.set_load(1, 1)
        if self._delay is not None and req.text.startswith(self._delay[0]):
            time.sleep(self._delay[1])
        self.to_gateway.send(self.builder.build(req))  # a Prompt, or a RequestError
        self.status.set_load(0, 1)
