"""The program's detokenizer over batches of wire chunks: `Codec` (no sockets: testable alone).

Chunks of one kind (row count, tail rows) decode together. A request's audio does not depend on
how its windows are batched: every decode call has one fixed size (`call_batch` windows, padded),
in the captured graphs of each batch bucket (a GPU) and on the eager path (a CPU, or
--disable-cuda-graph) alike, since convolutions round by batch size (oneDNN: a batch of 1, of 2-15
and of 16+ differ in the last bit; cuDNN on the H200: a convolutional codec's windows differ in a batch of 1, 2
and 8 in float16).

A failure fails only the requests whose windows cause it: a chunk of no known kind ends its own
request, and a batch whose decode raises is decoded again window by window, so its good windows
keep their audio. Programs with codec streams (programs/base.py, "Codec streams") decode in
rounds: round k holds each request's k-th waiting unit, each in its request's slot
(codec_worker/streams.py); a unit is a chunk, or up to `merge` consecutive chunks of a request
that decode as one window (the program's `codec_merge`), whose audio is split back per chunk.
Their failed batch fails all of its requests: how far it advanced their state is unknown. A
chunk 0 with a prefix (a primed stream: the program's `codec_prefix`) first decodes the prefix in
its fresh slot, in an eager call of its own outside the graphs, and then its window continues the
stream; a prefix that fails fails its request alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from codec_worker.graphs import DetokGraphs, Pending
from codec_worker.streams import IDLE_S, Slots, StreamError, rounds
from common.arrays import np_array
from common.messages import AudioChunk, DetokChunk, Finished, FinishReason
from common.pinned import ring, to_device
from programs.base import CodecStreams, LMProgram, pcm16
from programs.blocks import rng

log = logging.getLogger(__name__)

# The largest batch decoded at once by default (--codec-max-batch 0, a model without its own): on a
# GPU a full call's fixed cost is already spread thin at 128 (~1 ms over ~7 ms of windows on the
# H200), and a first chunk arriving during a call waits for it: larger calls buy little.
GPU_MAX_BATCH, CPU_MAX_BATCH = 128, 64
# Lead windows are first chunks only, and short tails a stream's next few frames: few per pass,
# graphs up to this batch by default (`--codec-lead-batch`)
LEAD_MAX_BATCH = 16
# Windows per decode call (a call of fewer is padded): on a CPU 4 costs a lone window ~1.8x a call
# of 1, and 16 windows take no longer than in one call of 16. On a GPU a graph runs its calls of 16
# side by side (codec_worker/graphs.py): large batches cost a tenth to a fifth more than one call
# (a convolutional codec, float16, H200), a lone window the time of 16.
CALL_BATCH = {"cpu": 4, "cuda": 16}
DEAD_KEPT = 4096  # failed requests remembered, to drop their later chunks and their own end


@dataclass
class FirstLane:
    """A request's first two chunks decoded while a pass runs (`--codec-first-lane`): graphs of the
    lead kinds and of the tail kinds a second chunk has (`Codec.second_kinds`) of their own, in a
    memory pool of their own (the pass's graphs share theirs, replayed one at a time), replayed on a
    high-priority CUDA stream beside the pass, so such a chunk does not wait for the next pass (on
    an H100 the lane's graphs end with the pass they run beside, not before it). The second chunk is
    a stream's tightest deadline (its first chunk's audio, often one frame, is all its listener
    has), so the gpu_worker sends first chunks after one frame with less allowed for its trip
    (`windows.LANE_DELIVERY_S`)."""

    graphs: dict[tuple[int, int], DetokGraphs]
    limits: dict[tuple[int, int], int]
    stream: torch.cuda.Stream


@dataclass
class Launched:
    """A launched decode: the chunks, per part its positions in them and the pending result, and
    the requests it failed (rid → the error end to send in place of their audio)."""

    chunks: list[DetokChunk]
    # per part: its units (positions of chunks decoded as one window each) and the pending result
    parts: list[tuple[list[list[int]], Pending]] = field(default_factory=list)
    failed: dict[str, Finished] = field(default_factory=dict)
    lane: bool = False  # launched in the first lane (a failed part is decoded again there)


class Codec:
    """The program's detokenizer over batches of wire chunks. On a GPU it replays captured graphs
    per row count and batch bucket unless `graphs` is False. `streams`: codec slots for a program
    with codec streams (its scratch slot comes on top), taken back from a stream idle `idle_s`."""

    def __init__(
        self,
        program: LMProgram,
        max_batch: int = 64,
        graphs: bool = True,
        progress=None,
        tails: bool = False,
        compile_backend: str | Callable | None = None,
        compile_fallback: bool = False,
        streams: int = 0,
        idle_s: float = IDLE_S,
        call_batch: int | None = None,
        merge: int = 1,
        benchmark_graphs: bool = False,
        compile_tails: bool = False,
        lead_batch: int = 0,
        compile_leads: bool = False,
        first_lane: bool = False,
    ) -> None:
        self.program = program
        self.device = program.device
        if self.device.type == "cuda" and torch.cuda.is_available():  # the pinned ring now, not
            ring("in")  # at the first cloned voice
        # Windows per decode call (None: the program's `codec_call_batch`, else CALL_BATCH for the
        # device; 0: graphs decode a bucket in one call, faster in large buckets but a window's bits
        # then depend on its bucket).
        if call_batch is None:
            call_batch = program.codec_call_batch or CALL_BATCH.get(self.device.type, 16)
        self.call_batch = call_batch
        self.eager_batch = self.call_batch or CALL_BATCH.get(self.device.type, 16)
        self.slots: Slots | None = None
        if program.codec_streams:
            if streams < 1:
                raise ValueError(f"{program.name} decodes codec streams: give it codec slots (streams)")
            self.slots = Slots(streams, idle_s)
            program.init_codec_streams(streams + 1)
        # Windows of a stream merged into one decode (codec streams only, `merge` at most: 1 = none)
        # (window groups: their sizes whatever `merge` says, and those only within a group)
        cap = max(merge, *program.detok_groups) if program.detok_groups else merge
        self.merge = tuple(m for m in program.codec_merge if 1 < m <= cap) if self.slots else ()
        self.dead: OrderedDict[str, None] = OrderedDict()  # failed requests whose end is yet to come
        # Regular windows (with codec streams merged ones too: `_compiles`) through the program's
        # compiled decode (`compile_backend`: torch.compile's backend; None: not compiled), graphed
        # or eager like the others. `compile_fallback`: if compiling fails (no compiler on this
        # host, say), decode them uncompiled, with a warning.
        self.compile_fallback = compile_fallback
        self.compiled = None
        # ... and with `compile_tails`, where the program's compiled decode takes them
        # (`codec_compiled_tails`), the tail windows of a regular window's rows (`--codec-compile-tails`)
        self.compile_tails = compile_tails and program.codec_compiled_tails and program.detok_tail
        if compile_backend:
            try:
                self.compiled = program.compiled_detokenize(compile_backend)
            except Exception as e:
                self._compile_failed(e)
            if self.compiled is None and not compile_fallback:
                raise ValueError(f"--codec-compile on: {program.name} has no compiled codec")
        # ... and with `compile_leads` (`--codec-compile-leads`), the lead windows (a request's first
        # chunk) of the sizes the program's compiled decode takes (`codec_compiled_leads`): the sizes
        # compiled, less any whose compile fails
        on = compile_leads and self.compiled is not None
        self.compile_leads = set(program.codec_compiled_leads if on else ())
        self.limits = self.window_limits(
            program,
            max_batch,
            lead_batch,
            self.merge,
            tails,
            bool(self.compile_tails),
            tuple(self.compile_leads),
        )
        self.graphs: dict[tuple[int, int], DetokGraphs] = {}
        self.lane: FirstLane | None = None
        if graphs and self.device.type == "cuda":
            # `benchmark_graphs`: cuDNN times each captured convolution shape's algorithms in the
            # graphs' warm-up and keeps the fastest (not its heuristic's pick); what is met later
            # is served as the process set it
            serving = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = serving or benchmark_graphs
            try:
                self._capture(progress)
                # ... and with `first_lane`, the lead kinds' graphs of the first lane (not for codec
                # streams, whose windows of a request decode in order in its slot)
                # (a lane that fails to capture stops the startup: the gpu_worker, which cannot
                # see it, sends first chunks on the promise of its shorter trip for the second)
                if first_lane and self.slots is None:
                    try:
                        self.lane = self._capture_lane(progress)
                    except Exception as e:
                        raise RuntimeError(
                            f"--codec-first-lane: capturing its graphs failed ({e}); the gpu_worker "
                            "allows second chunks the lane's shorter trip, so serve without the flag"
                        ) from e
            finally:
                torch.backends.cudnn.benchmark = serving
        else:
            self.limits = {kind: max_batch for kind in self.limits}  # eager: any batch
            if self.compiled is not None:  # compile now, not in the first request's decode
                if progress:
                    progress("compiling the codec")
                n = self.eager_batch
                streams = {}  # with codec streams: the scratch slot, whose state is garbage anyway
                if self.slots is not None:
                    streams = {"slots": np.full(n, self.slots.scratch, np.int64), "fresh": np.zeros(n, bool)}
                for rows, tail in self.limits:  # every kind the compiled decode takes
                    if self._compiles(rows, tail):
                        tokens = np.zeros((n, rows, program.n_codebooks), np.int64)
                        self._decode_eager(tokens, np.zeros(n, np.int64), tail=tail, **streams)

    def _capture(self, progress) -> None:
        p = self.program
        pool = torch.cuda.graph_pool_handle()
        scratch = None if self.slots is None else self.slots.scratch
        for (rows, tail), limit in self.limits.items():
            fn = self._compiled_fn(tail) if self._compiles(rows, tail) else None
            graphs = None
            try:  # a compile happens in the warm-up before the first capture
                graphs = DetokGraphs(
                    p, limit, progress, rows=rows, tail=tail, pool=pool, detokenize=fn, scratch=scratch,
                    call_batch=self.call_batch,
                )  # fmt: skip
            except Exception as e:
                if fn is None:
                    raise
                self._compile_failed(e, rows, tail)
            if graphs is None:  # captured again uncompiled, the failed attempt released
                # into a pool of its own: a pool whose graphs were all freed cannot be captured
                # into again (PyTorch's allocator asserts), as when the first kind's attempt fails
                pool = torch.cuda.graph_pool_handle()
                graphs = DetokGraphs(
                    p,
                    limit,
                    progress,
                    rows=rows,
                    tail=tail,
                    pool=pool,
                    scratch=scratch,
                    call_batch=self.call_batch,
                )
            self.graphs[rows, tail] = graphs

    def _capture_lane(self, progress) -> FirstLane:
        """The first lane's graphs: each lead kind's and each second chunk's tail kind's, up to
        LEAD_MAX_BATCH windows (a pass's worth of first chunks arriving in one pass), compiled
        where the pass's are."""
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(priority=-1)
        graphs, limits = {}, {}
        seconds = self.second_kinds()
        for kind, limit in self.limits.items():
            rows, tail = kind
            if not (kind in seconds or not tail and self._lead(rows)):
                continue
            fn = self._compiled_fn(tail) if self._compiles(rows, tail) else None
            limits[kind] = min(limit, LEAD_MAX_BATCH)
            # captured on the lane's stream: a captured GEMM keeps its capture stream's cuBLAS
            # workspace, and the pass's graphs, captured on torch's capture stream, run beside these
            graphs[kind] = DetokGraphs(
                self.program, limits[kind], progress, rows=rows, tail=tail, pool=pool, detokenize=fn,
                call_batch=self.call_batch, stream=stream,
            )  # fmt: skip
        return FirstLane(graphs, limits, stream)

    def second_kinds(self) -> set[tuple[int, int]]:
        """The window kinds of a second chunk in progressive mode (gpu_worker/windows.py `_tail`):
        after a lead of n rows, the newest frame as a tail window of up to a regular window's rows,
        for each lead size the program has (those among the kinds this codec decodes)."""
        p, s = self.program, self.program.detok_stride
        if not p.detok_tail:
            return set()
        kinds = {self._kind(min(n + s, p.detok_interval), s) for n in p.detok_lead}
        return {k for k in kinds if k[1] and k in self.limits}

    def lane_takes(self, c: DetokChunk) -> bool:
        """Whether the first lane decodes chunk `c`: a request's first chunk of a lead kind, or its
        second of a tail kind the lane has graphs of."""
        return (
            self.lane is not None
            and (c.index == 0 or c.index == 1 and c.tail_rows > 0)
            and self._chunk_kind(c) in self.lane.graphs
        )

    def lane_taker(self) -> Callable[[DetokChunk], bool]:
        """`lane_takes`, up to one lane graph's worth of each kind (the predicate of one take)."""
        left = dict(self.lane.limits) if self.lane is not None else {}

        def takes(c: DetokChunk) -> bool:
            if not self.lane_takes(c) or left[kind := self._chunk_kind(c)] <= 0:
                return False
            left[kind] -= 1
            return True

        return takes

    @staticmethod
    def done(launched: Launched) -> bool:
        """Whether a launch's decode has finished on the device (an eager one: computed when read)."""
        return all(p.done is None or p.done.query() for _, p in launched.parts)

    def _compiled_fn(self, tail: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The compiled decode of windows keeping `tail` rows (0: a regular or lead window's)."""
        compiled = self.compiled
        return compiled if not tail else lambda t, k: compiled(t, k, tail_rows=tail)

    def _compile_failed(self, error: Exception, rows: int = 0, tail: int = 0) -> None:
        """Decode every window uncompiled from here on (a compile of windows of `rows` rows keeping
        `tail` failing: of a tail window, the tail windows only; of a lead window, the lead windows
        of that size only), or (`--codec-compile on`) fail. Running out of GPU memory is no compile
        failure: it goes on up."""
        if not self.compile_fallback or isinstance(error, torch.cuda.OutOfMemoryError):
            raise error
        lead = rows if not tail and self._lead(rows) else 0
        if lead or tail:
            log.warning(
                "codec: the compiled decode of %s windows failed (%s: %s); decoding them uncompiled",
                f"{lead}-row lead" if lead else "tail", type(error).__name__, error,
            )  # fmt: skip
            if lead:
                self.compile_leads.discard(lead)
            else:
                self.compile_tails = False
            return
        log.warning(
            "codec: the compiled decode failed (%s: %s); decoding uncompiled", type(error).__name__, error
        )
        self.compiled = None

    def _compiles(self, rows: int, tail: int) -> bool:
        """Whether windows of this kind go through the compiled decode: regular windows, with
        codec streams merged ones too (a stream's decoder takes any number of frames), with
        `compile_tails` the tail windows of a regular window's rows, and the lead windows of the
        sizes in `compile_leads`."""
        p = self.program
        if self.compiled is None:
            return False
        if tail:
            return self.compile_tails and rows == p.detok_interval and tail == p.detok_stride
        return self._regular(rows) or rows in self.compile_leads

    def _regular(self, rows: int) -> bool:
        """Whether a window of `rows` rows and no tail is a regular window or a merged one."""
        return rows in (self.program.detok_interval, *(m * self.program.detok_interval for m in self.merge))

    def _lead(self, rows: int) -> bool:
        """Whether a window of `rows` rows and no tail is a lead window (not a regular or merged one)."""
        return rows in self.program.detok_lead and not self._regular(rows)

    @classmethod
    def window_limits(
        cls,
        program: LMProgram,
        max_batch: int,
        lead_batch: int = 0,
        merge: tuple[int, ...] = (),
        tails: bool = False,
        compile_tails: bool = False,
        compiled_leads: tuple[int, ...] = (),
    ) -> dict[tuple[int, int], int]:
        """The largest batch decoded at once (on a GPU: the largest graph), per window kind (rows,
        tail rows): regular windows and merged ones `max_batch`; lead windows, and with `tails`
        (--first-chunk progressive) the tail windows of 1-4 frames (a tail of all its rows is the
        whole window: kind (rows, 0), see `_kind`), `lead_batch` (at most `max_batch`; 0:
        LEAD_MAX_BATCH), but a full window's tails with `compile_tails` and the lead windows of the
        sizes `compiled_leads`: decoded as regular windows are, a burst's streams send them
        together (a kind whose compile fails later keeps its larger graphs, uncompiled)."""
        p, s = program, program.detok_stride
        lead = min(lead_batch, max_batch) if lead_batch else LEAD_MAX_BATCH
        kinds = {(p.detok_interval, 0): max_batch}
        kinds.update({(m * p.detok_interval, 0): max_batch for m in merge})
        if tails and p.detok_tail:
            kinds.update({cls._kind(r, s): lead for r in range(s, p.detok_interval + 1, s)})
            if compile_tails:
                kinds[cls._kind(p.detok_interval, s)] = max_batch
        # (a tail of all its rows is a lead window: one kind)
        kinds.update({(r, 0): max_batch if r in compiled_leads else lead for r in p.detok_lead})
        return kinds

    def _chunk_kind(self, c: DetokChunk) -> tuple[int, int]:
        """A chunk's window kind (its int32 token rows of `n_codebooks` codes, its tail rows)."""
        return self._kind(len(c.tokens) // (4 * self.program.n_codebooks), c.tail_rows)

    @staticmethod
    def _kind(rows: int, tail: int) -> tuple[int, int]:
        """A window's decode kind: (rows, tail rows kept), 0 for all of them."""
        return rows, (tail if tail < rows else 0)

    @torch.inference_mode()
    def _decode_eager(
        self,
        tokens: np.ndarray,
        keys: np.ndarray,
        tail: int = 0,
        slots: np.ndarray | None = None,
        fresh: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """tokens [n, R, C] int64, keys [n] (slots [n] int64, fresh [n] bool with codec streams) →
        PCM16 [n, S], valid [n], in calls of exactly `eager_batch` windows, so every call has one
        shape: padding entries repeat the first window (a window the program takes), with codec
        streams in the scratch slot, not fresh."""
        k, n = self.eager_batch, len(tokens)
        pad = -n % k
        tokens = np.concatenate([tokens, np.repeat(tokens[:1], pad, axis=0)])
        keys = np.concatenate([keys, np.repeat(keys[:1], pad)])
        t, kt = torch.from_numpy(tokens).to(self.device), torch.from_numpy(keys).to(self.device)
        st = ft = None
        if self.slots is not None:
            assert slots is not None and fresh is not None, "a program with codec streams needs slots"
            st = torch.from_numpy(np.concatenate([slots, np.full(pad, self.slots.scratch)])).to(self.device)
            ft = torch.from_numpy(np.concatenate([fresh, np.zeros(pad, bool)])).to(self.device)
        pcm, valid = [], []
        for lo in range(0, n + pad, k):
            audio = None
            streams = None if st is None else CodecStreams(st[lo : lo + k], ft[lo : lo + k])
            if self._compiles(t.shape[1], tail):
                try:
                    args = (t[lo : lo + k], kt[lo : lo + k])
                    fn = self._compiled_fn(tail)
                    audio, ok = fn(*args) if streams is None else fn(*args, streams=streams)
                except Exception as e:  # compiled at its first call
                    self._compile_failed(e, t.shape[1], tail)
            if audio is None:
                audio, ok = self.program.detokenize(
                    t[lo : lo + k], kt[lo : lo + k], tail_rows=tail, streams=streams
                )
            pcm.append(pcm16(audio).cpu().numpy())
            valid.append(ok.cpu().numpy())
        return np.concatenate(pcm)[:n], np.concatenate(valid)[:n]  # [n, S], [n]

    def decode(self, chunks: list[DetokChunk]) -> list[AudioChunk]:
        """One AudioChunk per chunk, in the chunks' order, but none for the chunks of a request the
        decode failed (`launch(...).failed` says why)."""
        return self.collect(self.launch(chunks))

    def launch(self, chunks: list[DetokChunk], lane: bool = False) -> Launched:
        """Queue the decode of `chunks` (graphs: nothing waits for the GPU; eager: computed when
        read). A chunk that cannot be decoded fails its request, and only it. `lane`: in the first
        lane (chunks it takes, `lane_takes`), on its stream."""
        if lane:
            assert self.lane is not None
            with torch.cuda.stream(self.lane.stream):
                out = self._launch(chunks, self.lane.graphs, self.lane.limits)
            out.lane = True
            return out
        return self._launch(chunks, self.graphs, self.limits)

    def _launch(
        self,
        chunks: list[DetokChunk],
        graphs: dict[tuple[int, int], DetokGraphs],
        limits: dict[tuple[int, int], int],
    ) -> Launched:
        p = self.program
        out = Launched(chunks)
        kinds: dict[int, tuple[int, int]] = {}  # position → window kind
        for i, c in enumerate(chunks):
            kind = self._chunk_kind(c)
            if c.rid in self.dead:
                continue  # its request has failed: its later chunks have nowhere to go
            if kind not in limits or len(c.tokens) % (4 * p.n_codebooks):
                self.fail(out, c.rid, self._bad_kind(c, kind))
                continue
            if c.prefix and (self.slots is None or c.index or len(c.prefix) % (4 * p.n_codebooks)):
                self.fail(out, c.rid, self._bad_prefix(c))
                continue
            if c.voice and (self.slots is None or c.index or not p.codec_voices):
                self.fail(
                    out,
                    c.rid,
                    f"codec error: chunk {c.index} of {c.rid} carries a voice; "
                    f"only a chunk 0 of a model with voiced codec streams may",
                )
                continue
            kinds[i] = kind
        live = [i for i in kinds if chunks[i].rid not in out.failed]
        regular = (p.detok_interval, 0)
        if self.slots is None:
            passes = [[[i] for i in live]]
        else:  # a request's units in index order, one per round
            grouped = bool(p.detok_groups)  # then only a group's windows merge
            passes = rounds(
                chunks,
                live,
                self.merge,
                lambda i: kinds[i] == regular and (not grouped or chunks[i].group >= 0),
            )
        for where in passes:
            # window kind → (unit, slot, fresh) of each unit of this round
            groups: dict[tuple[int, int], list[tuple[list[int], int, bool]]] = {}
            for unit in where:
                i = unit[0]
                slot, fresh = 0, False
                if self.slots is not None:
                    try:
                        slot, fresh = self.slots.take(chunks[i])
                    except StreamError as e:
                        self.fail(out, chunks[i].rid, str(e), e.status)
                        continue
                    if fresh and (p.codec_voices or chunks[i].prefix):
                        try:
                            if p.codec_voices:
                                self._voice(chunks[i], slot)
                            if chunks[i].prefix:
                                self._prime(chunks[i], slot)
                        except Exception as e:  # fails this request, not the others of its round
                            log.exception("codec failed starting the stream of %s", chunks[i].rid)
                            self.fail(out, chunks[i].rid, f"codec error: {type(e).__name__}: {e}")
                            continue
                        fresh = fresh and not chunks[i].prefix  # its window continues a primed stream
                kind = kinds[i] if len(unit) == 1 else (len(unit) * p.detok_interval, 0)
                groups.setdefault(kind, []).append((unit, slot, fresh))
            for kind, entries in groups.items():
                limit = limits[kind]
                for lo in range(0, len(entries), limit):
                    out.parts.append(self._launch_part(chunks, kind, entries[lo : lo + limit], graphs))
        return out

    def _bad_kind(self, c: DetokChunk, kind: tuple[int, int]) -> str:
        p = self.program
        return (
            f"codec error: chunk {c.index} of {c.rid} has {len(c.tokens) / (4 * p.n_codebooks):g} rows "
            f"(tail {kind[1]}); {p.name} windows have {p.detok_interval} (lead windows: "
            f"{list(p.detok_lead)}; tail windows: {sorted(t for t in self.limits if t[1])})"
        )

    def _bad_prefix(self, c: DetokChunk) -> str:
        p = self.program
        if self.slots is None:
            return f"codec error: chunk {c.index} of {c.rid} has a prefix; {p.name} has no codec streams"
        if c.index:
            return f"codec error: chunk {c.index} of {c.rid} has a prefix; only a chunk 0 may"
        return (
            f"codec error: chunk 0 of {c.rid} has a prefix of {len(c.prefix)} bytes, not rows of "
            f"{p.n_codebooks} int32 ids"
        )

    @torch.inference_mode()
    def _voice(self, chunk: DetokChunk, slot: int) -> None:
        """Condition `slot`'s stream on chunk 0's voice, or the default voice when it has none
        (programs/base.py, "Codec streams": voiced streams), queued on the device's current stream
        before the chunk's window."""
        voice = {k: self._to_device(torch.from_numpy(np_array(a).copy())) for k, a in chunk.voice.items()}
        self.program.set_codec_voice(slot, voice or None)

    @torch.inference_mode()
    def _prime(self, chunk: DetokChunk, slot: int) -> None:
        """Start `slot`'s stream with chunk 0's prefix rows (programs/base.py, "Codec streams"): the
        program's eager `prime_codec_streams` of them, [1, P, C], the audio dropped. It is queued on
        the device's current stream now, so it runs after every decode queued before and before the
        chunk's own window (a graph replay on that stream, or an eager decode run later)."""
        p = self.program
        rows = np.frombuffer(chunk.prefix, dtype="<i4").reshape(1, -1, p.n_codebooks).astype(np.int64)
        key = rng.mix_keys(torch.tensor([chunk.seed]), torch.tensor([chunk.noise_id]))
        slots = torch.tensor([slot], dtype=torch.int64)
        p.prime_codec_streams(*(self._to_device(t) for t in (torch.from_numpy(rows), key, slots)))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host → the codec's device without waiting for its stream (a copy from pageable memory
        would wait for every decode queued before it)."""
        return to_device(t, self.device)

    def _launch_part(
        self,
        chunks: list[DetokChunk],
        kind: tuple[int, int],
        entries: list[tuple[list[int], int, bool]],
        graphs: dict[tuple[int, int], DetokGraphs],
    ) -> tuple[list[list[int]], Pending]:
        """Queue one batch of windows of one kind: (unit, slot, fresh) each, a unit's chunks' rows
        as one window (its noise key its first chunk's)."""
        rows, tail = kind
        part = [u for u, _, _ in entries]
        tokens = np.stack(
            [np.concatenate([np.frombuffer(chunks[i].tokens, dtype="<i4") for i in u]) for u in part]
        ).astype(np.int64)
        tokens = tokens.reshape(len(part), rows, self.program.n_codebooks)
        seeds = torch.tensor([chunks[u[0]].seed for u in part], dtype=torch.int64)
        index = torch.tensor([chunks[u[0]].noise_id for u in part], dtype=torch.int64)
        keys = rng.mix_keys(seeds, index).numpy()  # [Bd] noise key per chunk
        slots = fresh = None
        if self.slots is not None:
            slots = np.array([s for _, s, _ in entries], dtype=np.int64)
            fresh = np.array([f for _, _, f in entries], dtype=bool)
        if kind in graphs:
            if slots is None:
                return part, graphs[kind].launch(tokens, keys)
            return part, graphs[kind].launch(tokens, keys, slots, fresh)
        if slots is None:
            return part, Pending.later(lambda: self._decode_eager(tokens, keys, tail))
        return part, Pending.later(lambda: self._decode_eager(tokens, keys, tail, slots, fresh))

    def would_wait(self, chunks: list[DetokChunk]) -> bool:
        """Whether `launch(chunks)` would first wait for an earlier launch: a window kind of theirs
        whose graphs hold a launch not yet read out (`DetokGraphs.launch` reads it before it queues
        another). Reading that launch out first instead costs no more waits. (A kind with more
        windows than one part holds waits for its own first part as well, whoever goes first: not
        counted here.) Eager decodes run when read and never wait at launch; merged units, whose
        kind is not a chunk's own, are not seen."""
        if not self.graphs:
            return False
        kinds = {self._chunk_kind(c) for c in chunks}
        return any(kind in self.graphs and self.graphs[kind].pending is not None for kind in kinds)

    def collect(self, launched: Launched) -> list[AudioChunk]:
        """Wait for a launch and turn it into AudioChunks, in its chunks' order, leaving out the
        chunks of the requests it failed (added to `launched.failed`)."""
        chunks = launched.chunks
        out: list[AudioChunk | None] = [None] * len(chunks)
        for part, pending in launched.parts:
            try:
                pcm, valid = pending.result()
            except Exception as e:
                log.exception("codec failed on %d windows", len(part))
                self._failed_part(launched, part, out, e)
                continue
            for unit, samples, ok in zip(part, pcm.astype("<i2"), valid, strict=True):
                # a merged window's audio and validity, each of its chunks' own
                oks = np.broadcast_to(np.asarray(ok).reshape(-1), (len(unit),))
                for i, piece, good in zip(unit, np.split(samples, len(unit)), oks, strict=True):
                    c = chunks[i]
                    out[i] = AudioChunk(c.rid, c.index, piece.tobytes() if good else b"")
        return [a for a in out if a is not None and a.rid not in launched.failed]

    def _failed_part(
        self, launched: Launched, part: list[list[int]], out: list[AudioChunk | None], error: Exception
    ) -> None:
        """A batch's decode raised: decode its windows one by one and fail the requests of those
        that fail alone (codec streams, or a window alone: fail them all)."""
        chunks = launched.chunks
        if self.slots is not None or len(part) == 1:
            for unit in part:
                self.fail(launched, chunks[unit[0]].rid, f"codec error: {type(error).__name__}: {error}")
            return
        for (i,) in part:  # without codec streams every unit is one chunk
            alone = self.launch([chunks[i]], lane=launched.lane)
            audio = self.collect(alone)
            launched.failed.update(alone.failed)
            if audio:
                out[i] = audio[0]

    def fail(self, launched: Launched | None, rid: str, message: str, status: int = 500) -> Finished:
        """End request `rid` with an error: its slot is freed, its later chunks and its own end
        dropped; → the error end (also recorded in `launched.failed`)."""
        end = Finished(rid, FinishReason.ERROR, message=message, status=status)
        if launched is not None:
            launched.failed.setdefault(rid, end)
        if self.slots is not None:
            self.slots.release(rid)
        self.dead[rid] = None
        while len(self.dead) > DEAD_KEPT:
            self.dead.popitem(last=False)
        return end

    def ended(self, finished: list[Finished]) -> list[Finished]:
        """Requests' ends on their way to the gateway: their slots are freed; the ends of requests
        already failed here are dropped (their error went out instead)."""
        out = []
        for f in finished:
            if self.slots is not None:
                self.slots.release(f.rid)
            if f.rid in self.dead:
                del self.dead[f.rid]
            else:
                out.append(f)
        return out
