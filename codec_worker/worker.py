"""The codec_worker process: batches ready chunks across requests and turns them into PCM16.

Windows arriving from several gpu_worker steps are gathered into one decode while every waiting
window's listener still has audio to play (`--codec-gather-ms`, codec_worker/gather.py); first
chunks go at once. A pass decodes everything gathered together (in batches of at most
`max_batch` windows of one kind: regular windows, each lead size and each tail size apart), and
each request's `Finished` is forwarded after its chunks, so the gateway sees a request's audio
complete before its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from codec_worker.gather import Gather
from codec_worker.graphs import DetokGraphs, Pending
from common.config import ServeConfig, program_kwargs, resolve_device
from common.ipc import PullChannel, PushChannel
from common.messages import (
    AudioChunk,
    AudioChunks,
    CodecInMsg,
    DetokChunk,
    Finished,
    FinishReason,
    GatewayInMsg,
    ProcState,
)
from common.proc import StatusReporter
from programs import get_spec, load_program_class
from programs.base import LMProgram, pcm16
from programs.blocks import rng

# A launched decode: the chunks, and per part (their positions in it) the pending result.
Launched = tuple[list[DetokChunk], list[tuple[list[int], Pending]]]

log = logging.getLogger(__name__)


LEAD_MAX_BATCH = 16  # lead windows are first chunks only: few per pass; graphs up to this batch


class Codec:
    """The program's detokenizer over batches of wire chunks (no sockets: testable alone). On a GPU
    it replays captured graphs per row count and batch bucket unless `graphs` is False."""

    def __init__(
        self,
        program: LMProgram,
        max_batch: int = 64,
        graphs: bool = True,
        progress=None,
        tails: bool = False,
        compile_backend: str | Callable | None = None,
        compile_fallback: bool = False,
    ) -> None:
        self.program = program
        self.device = program.device
        # Regular windows through the program's compiled decode (`compile_backend`: torch.compile's
        # backend; None: not compiled), graphed or eager like the others. `compile_fallback`: if
        # compiling fails (no compiler on this host, say), decode them uncompiled, with a warning.
        self.compile_fallback = compile_fallback
        self.compiled = None
        if compile_backend:
            try:
                self.compiled = program.compiled_detokenize(compile_backend)
            except Exception as e:
                self._compile_failed(e)
            if self.compiled is None and not compile_fallback:
                raise ValueError(f"--codec-compile on: {program.name} has no compiled codec")
        # Largest batch decoded at once, per window kind (rows, tail rows): regular windows, lead
        # and start windows, and with `tails` (--first-chunk progressive) the tail windows of 1-4 frames (a
        # tail of all its rows is the whole window: kind (rows, 0), see `_kind`).
        p, s = program, program.detok_stride
        kinds = {(p.detok_interval, 0): max_batch}
        # Lead windows and a stream's start windows (its first windows, less the preseed rows).
        kinds.update({(r, 0): LEAD_MAX_BATCH for r in (*p.detok_lead, *p.start_window_rows)})
        if tails and p.detok_tail:
            kinds.update({self._kind(r, s): LEAD_MAX_BATCH for r in range(s, p.detok_interval + 1, s)})
        self.limits = kinds
        self.graphs: dict[tuple[int, int], DetokGraphs] = {}
        if graphs and self.device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
            for (rows, tail), limit in self.limits.items():
                fn = self.compiled if (rows, tail) == (p.detok_interval, 0) else None
                graphs = None
                try:  # a compile happens in the warm-up before the first capture
                    graphs = DetokGraphs(
                        program, limit, progress, rows=rows, tail=tail, pool=pool, detokenize=fn
                    )
                except Exception as e:
                    if fn is None:
                        raise
                    self._compile_failed(e)
                if graphs is None:  # captured again uncompiled, the failed attempt released
                    graphs = DetokGraphs(program, limit, progress, rows=rows, tail=tail, pool=pool)
                self.graphs[rows, tail] = graphs
        else:
            self.limits = {kind: max_batch for kind in self.limits}  # eager: any batch
            if self.compiled is not None:  # compile now, not in the first request's decode
                if progress:
                    progress("compiling the codec")
                for n in (2, 1, 16):  # the dynamic batch, batch 1, and (a CPU guard) 16 and more
                    self._decode_eager(
                        np.zeros((n, p.detok_interval, p.n_codebooks), np.int64), np.zeros(n, np.int64)
                    )

    def _compile_failed(self, error: Exception) -> None:
        """Decode regular windows uncompiled from now on, or (`--codec-compile on`) fail. Running
        out of GPU memory is no compile failure: it goes on up."""
        if not self.compile_fallback or isinstance(error, torch.cuda.OutOfMemoryError):
            raise error
        log.warning(
            "codec: the compiled decode failed (%s: %s); decoding uncompiled", type(error).__name__, error
        )
        self.compiled = None

    @staticmethod
    def _kind(rows: int, tail: int) -> tuple[int, int]:
        """A window's decode kind: (rows, tail rows kept), 0 for all of them."""
        return rows, (tail if tail < rows else 0)

    @torch.inference_mode()
    def _decode_eager(
        self, tokens: np.ndarray, keys: np.ndarray, tail: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        t, k = torch.from_numpy(tokens).to(self.device), torch.from_numpy(keys).to(self.device)
        audio = None
        if self.compiled is not None and not tail and t.shape[1] == self.program.detok_interval:
            try:
                audio, valid = self.compiled(t, k)
            except Exception as e:  # compiled at its first call
                self._compile_failed(e)
        if audio is None:
            audio, valid = self.program.detokenize(t, k, tail_rows=tail)
        return pcm16(audio).cpu().numpy(), valid.cpu().numpy()  # [Bd, S], [Bd]

    def decode(self, chunks: list[DetokChunk]) -> list[AudioChunk]:
        """One AudioChunk per chunk, in the chunks' order; chunks of one kind (row count, tail rows)
        decode together."""
        return self.collect(self.launch(chunks))

    def launch(self, chunks: list[DetokChunk]) -> Launched:
        """Queue the decode of `chunks` (graphs: nothing waits for the GPU; eager: computed now)."""
        p = self.program
        groups: dict[tuple[int, int], list[int]] = {}  # window kind → positions in `chunks`
        for i, c in enumerate(chunks):
            kind = self._kind(len(c.tokens) // (4 * p.n_codebooks), c.tail_rows)
            if kind not in self.limits:
                raise ValueError(
                    f"chunk {c.index} of {c.rid} has {kind[0]} rows (tail {kind[1]}); {p.name} windows have "
                    f"{p.detok_interval} (lead or start windows: "
                    f"{list(p.detok_lead or p.start_window_rows)}; "
                    f"tail windows: {sorted(t for t in self.limits if t[1])})"
                )
            groups.setdefault(kind, []).append(i)
        parts = []
        for kind, where in groups.items():
            rows, tail = kind
            limit = self.limits[kind]
            for lo in range(0, len(where), limit):
                part = where[lo : lo + limit]
                tokens = np.stack([np.frombuffer(chunks[i].tokens, dtype="<i4") for i in part]).astype(
                    np.int64
                )
                seeds = torch.tensor([chunks[i].seed for i in part], dtype=torch.int64)
                index = torch.tensor([chunks[i].noise_id for i in part], dtype=torch.int64)
                keys = rng.mix_keys(seeds, index).numpy()  # [Bd] noise key per chunk
                tokens = tokens.reshape(len(part), rows, p.n_codebooks)
                if kind in self.graphs:
                    pending = self.graphs[kind].launch(tokens, keys)
                else:
                    pending = Pending.later(lambda t=tokens, k=keys, tl=tail: self._decode_eager(t, k, tl))
                parts.append((part, pending))
        return chunks, parts

    def collect(self, launched: Launched) -> list[AudioChunk]:
        """Wait for a launch and turn it into AudioChunks, in its chunks' order."""
        p = self.program
        chunks, parts = launched
        out: list[AudioChunk | None] = [None] * len(chunks)
        for part, pending in parts:
            pcm, valid = pending.result()
            for i, samples, ok in zip(part, pcm.astype("<i2"), valid, strict=True):
                c = chunks[i]
                if c.n_rows:  # a request's padded last window: only its real rows' samples
                    samples = samples[: c.n_rows * p.detok_samples // p.detok_stride]
                out[i] = AudioChunk(c.rid, c.index, samples.tobytes() if ok else b"")
        return out  # type: ignore[return-value]


def codec_compile_backend(choice: str, device: str, program: LMProgram, graphs: bool) -> str | None:
    """--codec-compile → torch.compile's backend for the regular windows, or None: `on` compiles
    (with Triton on a GPU), `off` never, `auto` when the windows run as CUDA graphs on a GPU with
    Triton and the program has a compiled codec (a CPU compile needs a C++ toolchain and gains
    little there)."""
    if choice == "off":
        return None
    if choice == "on":
        return "inductor"
    from torch.utils._triton import has_triton

    gpu = device.startswith("cuda") and graphs and has_triton()
    return (
        "inductor" if gpu and type(program).compiled_detokenize is not LMProgram.compiled_detokenize else None
    )


class CodecWorker:
    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        cfg.codec.check()
        device = resolve_device(cfg.codec.device if cfg.codec.device != "auto" else cfg.device)
        if device.startswith("cuda"):
            # TF32 convolutions drift ~5e-4 from fp32 and vary with the batch size; keep fp32 exact
            # so a chunk decodes the same alone or batched.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(spec, device=device, **program_kwargs(cfg))
        dtype = str(program.codec_dtype).removeprefix("torch.")
        status.set(ProcState.LOADING, f"loading {spec['name']} codec ({dtype}) on {device}")
        program.load_codec()
        self.codec = Codec(
            program,
            # 128: a full call's fixed cost is already spread thin (~1 ms over ~7 ms of windows on the
            # H200), and a first chunk arriving during a call waits for it: larger calls buy little.
            max_batch=cfg.codec.max_batch or (128 if device.startswith("cuda") else 64),
            graphs=cfg.codec.cuda_graphs,
            progress=lambda msg: status.set(ProcState.LOADING, msg),
            tails=cfg.gpu.first_chunk == "progressive",
            compile_fallback=cfg.codec.compile == "auto",
            compile_backend=codec_compile_backend(cfg.codec.compile, device, program, cfg.codec.cuda_graphs),
        )
        self.status = status
        self.inbox: PullChannel[CodecInMsg] = PullChannel(cfg.addresses.codec_in, CodecInMsg, bind=True)
        self.to_gateway: PushChannel[GatewayInMsg] = PushChannel(cfg.addresses.gateway_in)
        regular = (program.detok_interval, 0)
        self.gather = Gather(cfg.codec.gather_ms / 1000, self.codec.limits[regular])
        # Heartbeat metrics: windows per call and the busy share show what gathering buys.
        self.counters = {"codec_calls_total": 0, "codec_windows_total": 0, "codec_busy_seconds_total": 0.0}
        status.set_load(0, 0, dict(self.counters))

    def run(self) -> None:
        gather = self.gather
        drained = time.monotonic()
        while True:
            batches = self.inbox.drain(timeout_ms=gather.wait_ms(time.monotonic()))
            # These were queued after the last drain emptied the socket: count from then (a
            # message that waited out a decode pass has that much less slack left).
            arrived, drained = drained, time.monotonic()
            for b in batches:
                ends = gather.add(b, arrived)
                if ends:
                    self.to_gateway.send(AudioChunks(chunks=[], finished=ends))
            if not gather.due(time.monotonic()):
                continue
            urgent, rest, finished = gather.take()
            self._decode_and_send([(urgent, [] if rest else finished), (rest, finished if rest else [])])

    def _decode_and_send(self, groups: list[tuple[list[DetokChunk], list[Finished]]]) -> None:
        """One pass: queue every group's decode, then wait for each in turn and send it with its
        ends. The urgent group (first chunks, streams running late) goes first and leaves as soon
        as its own decode is done; the GPU runs the whole pass in one go (see codec_worker/graphs.py
        on why the waits are what costs)."""
        t0 = time.perf_counter()
        launched = []  # (pending or the launch's error, chunks, ends), in the groups' order
        for chunks, finished in groups:
            if chunks:
                try:
                    launched.append((self.codec.launch(chunks), chunks, finished))
                except Exception as e:  # fails this group's requests (below, in order), not the process
                    launched.append((e, chunks, finished))
        n = 0
        for pending, chunks, finished in launched:
            try:
                if isinstance(pending, Exception):
                    raise pending
                audio = self.codec.collect(pending)
            except Exception as e:
                log.exception("codec failed on %d chunks", len(chunks))
                self._fail(chunks, finished, f"codec error: {type(e).__name__}: {e}")
                continue
            self.to_gateway.send(AudioChunks(chunks=audio, finished=finished))
            n += len(chunks)
        if not launched:
            return
        took = time.perf_counter() - t0
        self.gather.decoded(took)
        c = self.counters
        c["codec_calls_total"] += 1  # passes: each waits for the GPU once per group at most
        c["codec_windows_total"] += n
        c["codec_busy_seconds_total"] += took
        self.status.set_load(0, 0, dict(c))

    def _fail(self, chunks: list[DetokChunk], finished: list[Finished], message: str) -> None:
        """The requests with chunks in a failed decode end with an error; the other ends held
        with it go on as they were."""
        failed = {c.rid for c in chunks}
        fails = [Finished(rid, FinishReason.ERROR, message=message, status=500) for rid in sorted(failed)]
        self.to_gateway.send(
            AudioChunks(chunks=[], finished=fails + [f for f in finished if f.rid not in failed])
        )
