"""The codec_worker process: batches ready chunks across requests and turns them into PCM16.

Windows arriving from several gpu_worker steps are gathered into one decode while every waiting
window's listener still has audio to play (`--codec-gather-ms`, codec_worker/gather.py); first
chunks go at once. A pass decodes everything gathered together (in batches of at most
`max_batch` windows of one kind: regular windows, each lead size and each tail size apart), and
each request's `Finished` is forwarded after its chunks, so the gateway sees a request's audio
complete before its end. For a program with codec streams that end also frees the request's codec
slot (codec_worker/streams.py; `--codec-streams` slots). The decoding itself: codec_worker/codec.py.

A program that clones voices (`reference_sample_rate` > 0) also gets its reference encoders loaded
here, and the gateway's `EncodeRequest`s are encoded in bounded batches between codec passes: the
windows gathered go first, so a window waits for at most one bounded encode pass
(codec_worker/encode.py).
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from codec_worker.codec import CPU_MAX_BATCH, GPU_MAX_BATCH, LEAD_MAX_BATCH, Codec, Launched
from codec_worker.encode import Encodes
from codec_worker.gather import Gather
from common.config import ServeConfig, program_kwargs, resolve_device
from common.ipc import PullChannel, PushChannel
from common.late_imports import LateImports, describe
from common.messages import (
    AudioChunks,
    CodecInMsg,
    DetokBatch,
    DetokChunk,
    EncodeRequest,
    Finished,
    GatewayInMsg,
    ProcState,
)
from common.proc import StatusReporter
from programs import get_spec, load_program_class
from programs.base import LMProgram

__all__ = ["LEAD_MAX_BATCH", "Codec", "CodecWorker", "codec_compile_backend", "cudnn_benchmark"]

log = logging.getLogger(__name__)
# On a GPU, a decode pass past this is logged with its windows (a pass of 128 regular windows takes
# a few ms on the H200); at most one line every SLOW_LOG_S.
SLOW_PASS_S, SLOW_LOG_S = 0.04, 1.0
# With the first lane (--codec-first-lane), how often a pass's wait for the device looks for first
# chunks that arrived and for the group's end: either is seen at most this late.
LANE_POLL_S = 0.0002


def cudnn_benchmark(choice: str) -> tuple[bool, bool]:
    """--codec-cudnn-benchmark → (cuDNN's benchmark for the process while it serves, and while the
    codec graphs are captured): on times every shape, auto the graphs' alone, off none."""
    return choice == "on", choice != "off"


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
    slow_pass_s = float("inf")  # a pass logged past it (`_slow`): SLOW_PASS_S on a GPU
    slow_passes = 0
    _slow_log_at = -SLOW_LOG_S

    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        cfg.codec.check()
        device = resolve_device(cfg.codec.device if cfg.codec.device != "auto" else cfg.device)
        benchmark_serving, benchmark_graphs = cudnn_benchmark(cfg.codec.cudnn_benchmark)
        if device.startswith("cuda"):
            # TF32 convolutions drift ~5e-4 from fp32 and vary with the batch size; keep fp32 exact
            # so a chunk decodes the same alone or batched.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.benchmark = benchmark_serving
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(spec, device=device, **program_kwargs(cfg))
        dtype = str(program.codec_dtype).removeprefix("torch.")
        status.set(ProcState.LOADING, f"loading {spec['name']} codec ({dtype}) on {device}")
        program.load_codec()
        if program.reference_sample_rate > 0:
            status.set(ProcState.LOADING, f"loading {spec['name']} reference encoders on {device}")
            program.load_encoders()
        self.encodes = Encodes(program)
        self.decoded_last = False  # the last pass decoded windows (the next, with clips waiting, encodes)
        self.codec = Codec(
            program,
            max_batch=cfg.codec.max_batch
            or program.codec_max_batch
            or (GPU_MAX_BATCH if device.startswith("cuda") else CPU_MAX_BATCH),
            graphs=cfg.codec.cuda_graphs,
            progress=lambda msg: status.set(ProcState.LOADING, msg),
            tails=cfg.gpu.first_chunk == "progressive",
            compile_fallback=cfg.codec.compile == "auto",
            compile_backend=codec_compile_backend(cfg.codec.compile, device, program, cfg.codec.cuda_graphs),
            # codec slots (programs with codec streams): by the gpu_worker's batch size by default
            streams=cfg.codec.streams_for(cfg.gpu.filled(resolve_device(cfg.device), 0).max_batch_size),
            call_batch=None if cfg.codec.call_batch < 0 else cfg.codec.call_batch,
            merge=cfg.codec.merge,
            benchmark_graphs=benchmark_graphs,
            compile_tails=cfg.codec.compile_tails,
            lead_batch=cfg.codec.lead_batch,
            # (no lead windows come with reference first chunks: nothing to compile)
            compile_leads=cfg.codec.compile_leads and cfg.gpu.first_chunk != "reference",
            first_lane=cfg.codec.first_lane,
        )
        self.status = status
        self.inbox: PullChannel[CodecInMsg] = PullChannel(cfg.addresses.codec_in, CodecInMsg, bind=True)
        self.to_gateway: PushChannel[GatewayInMsg] = PushChannel(cfg.addresses.gateway_in)
        regular = (program.detok_interval, 0)
        self.gather = Gather(cfg.codec.gather_ms / 1000, self.codec.limits[regular])
        # Heartbeat metrics: windows per call and the busy share show what gathering buys.
        self.counters = {
            "codec_calls_total": 0,
            "codec_windows_total": 0,
            "codec_busy_seconds_total": 0.0,
            "encode_clips_total": 0,
            "encode_busy_seconds_total": 0.0,
            "codec_first_lane_windows_total": 0,
        }
        status.set_load(0, 0, dict(self.counters))
        if self.codec.device.type == "cuda":
            self.slow_pass_s = SLOW_PASS_S

    def run(self) -> None:
        drained = time.monotonic()
        late = LateImports()  # what startup loaded: an import from here on waits inside a pass
        while True:
            drained = self.turn(drained)
            imported = late.check()
            if imported:
                log.warning("a pass imported %s: import them at startup", describe(imported))

    def turn(self, drained: float) -> float:
        """One turn of the loop: take what arrived, decode what is due, else encode one bounded
        batch of waiting clips; → when the inbox was last emptied. With clips waiting, decode and
        encode passes take turns: the windows gathered so far are decoded at once rather than left
        to wait out an encode, so a window waits for at most one encode pass, and a clip for at
        most one decode pass per batch ahead of it, however busy the codec is."""
        wait = 0 if self.encodes.waiting else self.gather.wait_ms(time.monotonic())
        msgs = self.inbox.drain(timeout_ms=wait)
        # These were queued after the last drain emptied the socket: count from then (a message
        # that waited out a decode pass has that much less slack left).
        arrived, drained = drained, time.monotonic()
        self.receive(msgs, arrived)
        if self.encodes.waiting and (self.decoded_last or not self.gather.chunks):
            self.encode_pass()
            self.decoded_last = False
        elif self.gather.due(time.monotonic()) or (self.encodes.waiting and self.gather.chunks):
            self.decode_pass()
            self.decoded_last = self.encodes.waiting  # clips waited out this pass: they go next
        return drained

    def receive(self, msgs: list[CodecInMsg], arrived: float, held: list[Finished] | None = None) -> None:
        """Gather the batches' windows (the ends of requests with no window waiting go at once, or
        into `held` during a pass: their last windows may be in it) and queue the clips to encode."""
        for msg in msgs:
            match msg:
                case DetokBatch():
                    ends = self.gather.add(msg, arrived)
                    if held is not None:  # `ended` when they go: the pass may yet fail their request
                        held.extend(ends)
                    elif ends := self.codec.ended(ends):
                        self.to_gateway.send(AudioChunks(chunks=[], finished=ends))
                case EncodeRequest():
                    refused = self.encodes.add(msg)
                    if refused is not None:
                        self.to_gateway.send(refused)
                case _:
                    raise TypeError(f"unexpected message type {type(msg).__name__} on the codec inbox")

    def encode_pass(self) -> None:
        """Encode one bounded batch of the waiting clips and send each its reply."""
        t0 = time.perf_counter()
        batch = self.encodes.take()
        for reply in self.encodes.encode(batch):
            self.to_gateway.send(reply)
        c = self.counters
        c["encode_clips_total"] += len(batch)
        c["encode_busy_seconds_total"] += time.perf_counter() - t0
        self.status.set_load(0, 0, dict(c))

    def decode_pass(self) -> None:
        """Decode and send everything gathered: the urgent group, then the rest."""
        urgent, rest, finished = self.gather.take(time.monotonic())
        self._decode_and_send([(urgent, [] if rest else finished), (rest, finished if rest else [])])

    def _decode_and_send(self, groups: list[tuple[list[DetokChunk], list[Finished]]]) -> None:
        """One pass: queue every group's decode, then wait for each in turn and send it with its
        ends. The urgent group (first chunks, streams running late or with less audio left than a
        pass takes) goes first and leaves as soon as its own decode is done; the GPU runs the whole
        pass in one go (see codec_worker/graphs.py on why the waits are what costs). A group whose
        launch would first wait for a group before it (`Codec.would_wait`: a window kind the urgent
        group holds too, such as tails of streams running short beside the playing streams' tails)
        is launched only once the groups before it are sent, at no more waits: the urgent windows
        do not wait behind the rest's launches."""
        if not any(chunks for chunks, _ in groups):
            return
        t0 = time.perf_counter()
        launched: list[tuple[Launched | Exception, list[DetokChunk], list[Finished]]] = []
        self._held: list[Finished] = []  # ends that come during the pass (`_first_lane`), sent after it
        self._lane_s = 0.0  # the first lane's decodes during the pass, seconds
        n = 0
        for chunks, finished in groups:  # (pending or the launch's error, chunks, ends), in order
            if chunks:
                if launched and self.codec.would_wait(chunks):
                    n += self._send(launched)
                    launched = []
                try:
                    launched.append((self.codec.launch(chunks), chunks, finished))
                except Exception as e:  # fails this group's requests (below, in order), not the process
                    launched.append((e, chunks, finished))
        n += self._send(launched)
        # after the pass's audio (a request's last windows may have been in it), and not the end of a
        # request the pass failed (its error went out instead)
        if ends := self.codec.ended(self._held):
            self.to_gateway.send(AudioChunks(chunks=[], finished=ends))
        took = time.perf_counter() - t0 - self._lane_s  # the pass's own time, not the lane's decodes in it
        if took > self.slow_pass_s:
            self._slow(took, groups)
        self.gather.decoded(took)
        c = self.counters
        c["codec_calls_total"] += 1  # passes: each waits for the GPU once per group at most
        c["codec_windows_total"] += n
        c["codec_busy_seconds_total"] += took
        self.status.set_load(0, 0, dict(c))

    def _send(self, launched: list[tuple[Launched | Exception, list[DetokChunk], list[Finished]]]) -> int:
        """Wait for each launched group in turn and send its audio with its ends (a group whose
        launch or decode failed: its requests' errors); while a pass's group (not a lane's own)
        decodes, the first chunks that arrive meanwhile go through the first lane (`_first_lane`).
        → the windows sent."""
        n = 0
        for pending, chunks, finished in launched:
            if self.codec.lane is not None and isinstance(pending, Launched) and not pending.lane:
                n += self._first_lane(pending)
            try:
                if isinstance(pending, Exception):
                    raise pending
                audio = self.codec.collect(pending)
            except Exception as e:
                log.exception("codec failed on %d chunks", len(chunks))
                self._fail(chunks, finished, f"codec error: {type(e).__name__}: {e}")
                continue
            # The requests this decode failed end with their error, before the ends held with it.
            ends = list(pending.failed.values()) + self.codec.ended(finished)
            self.to_gateway.send(AudioChunks(chunks=audio, finished=ends))
            n += len(audio)
        return n

    def _first_lane(self, pending: Launched) -> int:
        """While `pending` decodes on the device: take what arrives (polling every LANE_POLL_S),
        and decode the first chunks among it at once in the codec's first lane, at most a lane
        graph's worth of a kind at a time (a burst's flood waits for the pass's larger graphs),
        each lane group sent with its requests' held ends as soon as it is done. → the windows
        sent."""
        n, look = 0, True  # look: what waits may hold first chunks the lane has not been offered
        while not self.codec.done(pending):
            arrived = time.monotonic()
            msgs = self.inbox.drain()
            if msgs:
                self.receive(msgs, arrived, self._held)
            # the waiting windows are scanned again only when some arrived or the last take took
            # some (the rest of a kind past a lane graph's worth), not at every poll
            firsts, ends = self.gather.take_where(self.codec.lane_taker()) if msgs or look else ([], [])
            look = bool(firsts)
            if not firsts:
                time.sleep(LANE_POLL_S)
                continue
            t0 = time.perf_counter()
            try:
                group: Launched | Exception = self.codec.launch(firsts, lane=True)
            except Exception as e:  # fails these requests (in `_send`), not the process
                group = e
            sent = self._send([(group, firsts, ends)])
            self._lane_s += time.perf_counter() - t0
            self.counters["codec_first_lane_windows_total"] += sent
            n += sent
        return n

    def _slow(self, took: float, groups: list[tuple[list[DetokChunk], list[Finished]]]) -> None:
        """Log a pass past `slow_pass_s` with its windows by kind (rows, tail rows: count), at most
        once every SLOW_LOG_S (a codec sharing the GPU with the LM is a suspect of the LM's slow
        steps: gpu_worker/engine.py)."""
        self.slow_passes += 1
        now = time.monotonic()
        if now - self._slow_log_at < SLOW_LOG_S:
            return
        self._slow_log_at = now
        kinds = collections.Counter((len(c.tokens) // (4 * self.codec.program.n_codebooks), c.tail_rows)
                                    for chunks, _ in groups for c in chunks)  # fmt: skip
        log.warning(
            "slow pass: %.1f ms for %s windows (rows, tail rows: count), %d slow passes so far",
            1000 * took, dict(kinds), self.slow_passes,
        )  # fmt: skip

    def _fail(self, chunks: list[DetokChunk], finished: list[Finished], message: str) -> None:
        """The requests with chunks in a failed decode end with an error; the other ends held
        with it go on as they were."""
        fails = [self.codec.fail(None, rid, message) for rid in sorted({c.rid for c in chunks})]
        self.to_gateway.send(AudioChunks(chunks=[], finished=fails + self.codec.ended(finished)))
