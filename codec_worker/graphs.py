"""CUDA graphs for the codec: one captured `detokenize` (+ PCM16 conversion) per batch bucket, for
one window row count (the regular `detok_interval`, or a lead size: one `DetokGraphs` each).

Inputs live in one device arena (tokens, then noise keys, then for codec streams each entry's
slot and fresh flag) filled from a pinned host mirror with one copy; a replay writes PCM16 and the
valid flags, read back with one copy into pinned host buffers. Padding entries hold token 0, an
invalid window that the program clamps and decodes harmlessly; their output is dropped. With codec
streams they decode in the scratch slot (not fresh), so no request's state is touched.

A row's audio does not depend on the bucket it is replayed in: with `call_batch` (the codec
worker's default on a GPU) a bucket's graph decodes its windows in calls of exactly that many
windows, so every convolution sees one shape whatever the bucket (cuDNN picks a convolution's
algorithm by its shape: a convolutional codec's windows round differently in a batch of 1, 2 or 8
on the H200; a window's place within a call changes nothing). `call_batch` 0 decodes a bucket in one call.

`launch` only queues that work and returns a `Pending`: the codec_worker queues every kind of
window of a pass (and the urgent and the gathered windows) before it waits once, unless a launch of
the gathered windows would wait anyway (for a launch of the same kind: `Codec.would_wait`); then
the urgent windows are read and sent first. Each wait for
the GPU gives the GPU back to the LM process, and without MPS each return of the codec costs the
LM a time slice: measured on the H200 under load, ~3-4 ms of LM time per codec call whatever its
size, when a pass waited once per window kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from common.graphs import capture
from programs.base import CodecStreams, LMProgram, pcm16

log = logging.getLogger(__name__)

SIDE_STREAMS = 8  # a bucket's calls of `call_batch` windows run on up to this many streams at once


def codec_buckets(max_batch: int, call_batch: int = 0) -> list[int]:
    """Batch sizes with a graph: doubling to 32, then 1.5x steps between (48, 96, 192, …), so a
    gathered batch pads by at most a third above 32. With `call_batch` c, the multiples of c among
    them (c itself the smallest; max_batch rounded up to one)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        if b >= 32 and b * 3 // 2 < max_batch:
            sizes.append(b * 3 // 2)
        b *= 2
    sizes.append(max_batch)
    if call_batch:
        sizes = sorted({-(-s // call_batch) * call_batch for s in sizes})
    return sizes


class DetokGraphs:
    def __init__(
        self,
        program: LMProgram,
        max_batch: int,
        progress: Callable[[str], None] | None = None,
        rows: int = 0,
        pool: tuple | None = None,
        tail: int = 0,
        detokenize: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        scratch: int | None = None,
        call_batch: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """`scratch`: the program's scratch slot, for a program with codec streams (None: none).
        `call_batch`: windows per detokenize call inside a graph (0: the whole bucket). `stream`:
        the stream to capture on (None: torch's capture stream; `common.graphs.capture`)."""
        self.capture_stream = stream
        self.program = program
        self.call_batch = call_batch
        self.scratch = scratch
        # What the graphs capture: the program's detokenize, or a compiled one (the kinds it takes).
        self.detokenize = detokenize or (
            lambda t, k, streams=None: program.detokenize(t, k, tail_rows=self.tail, streams=streams)
        )
        compiling = (
            " (compiling first: torch.compile, cached on disk after the first start)" if detokenize else ""
        )
        self.sizes = codec_buckets(max_batch, call_batch)
        self.max_batch = self.sizes[-1]
        p, dev = program, program.device
        self.rows = rows or p.detok_interval  # token rows per window
        self.tail = tail  # > 0: tail windows (only the last `tail` rows' audio)
        self.row = self.rows * p.n_codebooks
        bmax = self.sizes[-1]
        # Arena: [tokens bmax*row | keys bmax | slots bmax | fresh bmax] int64 (no slots without streams).
        extra = 1 if scratch is None else 3
        self.host = torch.zeros(bmax * (self.row + extra), dtype=torch.int64).pin_memory()
        self.dev = torch.zeros_like(self.host, device=dev)
        self.tokens = self.dev[: bmax * self.row].view(bmax, self.rows, p.n_codebooks)
        self.keys = self.dev[bmax * self.row : bmax * (self.row + 1)]
        self.slots = self.dev[bmax * (self.row + 1) : bmax * (self.row + 2)]
        self.fresh = self.dev[bmax * (self.row + 2) :]
        if scratch is not None:  # the warm-up and capture decode in the scratch slot only
            self.slots.fill_(scratch)
        # Graphs of several row counts may share one pool: they replay one at a time, and each
        # replay's outputs are copied out before the next.
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.pending: Pending | None = None  # the last launch, until its results are read
        calls = -(-self.sizes[-1] // call_batch) if call_batch else 1
        self._side_streams = [torch.cuda.Stream() for _ in range(min(calls, SIDE_STREAMS))]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        t0 = time.monotonic()
        for i, bs in enumerate(reversed(self.sizes)):
            if progress:
                progress(
                    f"capturing codec graphs: {self.rows} rows, batch {bs} ({i + 1}/{len(self.sizes)})"
                    + (compiling if i == 0 else "")
                )
            self.graphs[bs] = self._capture(bs)
        _, pcm, valid = self.graphs[bmax]
        self.pcm_host = torch.empty((bmax, pcm.shape[1]), dtype=pcm.dtype).pin_memory()  # a launch's results
        # [bmax] or [bmax, m]: a merged window's validity per window (programs/base.py, codec_merge)
        self.valid_host = torch.empty((bmax, *valid.shape[1:]), dtype=valid.dtype).pin_memory()
        log.info(
            "captured %d codec graphs (%d rows, batch %s) in %.1f s",
            len(self.sizes),
            self.rows,
            self.sizes,
            time.monotonic() - t0,
        )

    @torch.inference_mode()
    def _capture(self, bs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        def call(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            if self.scratch is None:
                return self.detokenize(self.tokens[lo:hi], self.keys[lo:hi])
            streams = CodecStreams(self.slots[lo:hi], self.fresh[lo:hi] != 0)
            return self.detokenize(self.tokens[lo:hi], self.keys[lo:hi], streams=streams)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            c = self.call_batch or bs
            if c >= bs:
                audio, valid = call(0, bs)
                return pcm16(audio), valid
            # The calls are independent (their own windows and slots; padding entries share only
            # the scratch slot, whose state is garbage anyway): each on a side stream, forked from
            # and joined to the capturing stream, so the graph runs them side by side. A call of 16
            # leaves most of the GPU idle (launch-bound small kernels).
            main = torch.cuda.current_stream()
            parts = []
            for j, lo in enumerate(range(0, bs, c)):
                side = self._side_streams[j % len(self._side_streams)]
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    parts.append(call(lo, lo + c))
            for side in self._side_streams[: len(parts)]:  # joins only the streams forked here
                main.wait_stream(side)
            audio, valid = torch.cat([a for a, _ in parts]), torch.cat([v for _, v in parts])
            return pcm16(audio), valid

        graph, (pcm, valid) = capture(step, self.pool, self.capture_stream)
        return graph, pcm, valid

    def launch(
        self,
        tokens: np.ndarray,
        keys: np.ndarray,
        slots: np.ndarray | None = None,
        fresh: np.ndarray | None = None,
    ) -> Pending:
        """Queue the decode of tokens [n, rows, C] int64, keys [n] int64 (n ≤ max_batch), and with
        codec streams slots [n] int64, fresh [n] bool; → its Pending. The host arena and output
        buffers are this object's: a launch first reads out the previous launch's results, if
        nobody has yet."""
        if self.pending is not None:
            self.pending.result()  # waits for the previous copies in and out
        n = len(tokens)
        bs = next(s for s in self.sizes if s >= n)
        bmax = self.sizes[-1]
        self.host.zero_()
        self.host[: n * self.row].copy_(torch.from_numpy(tokens.reshape(-1)))
        self.host[bmax * self.row : bmax * self.row + n].copy_(torch.from_numpy(keys))
        if self.scratch is not None:
            assert slots is not None and fresh is not None, "a program with codec streams needs slots"
            at = bmax * (self.row + 1)
            self.host[at : at + bmax].fill_(self.scratch)  # padding: the scratch slot, not fresh
            self.host[at : at + n].copy_(torch.from_numpy(slots))
            self.host[at + bmax : at + bmax + n].copy_(torch.from_numpy(fresh.astype(np.int64)))
        self.dev.copy_(self.host, non_blocking=True)
        graph, pcm, valid = self.graphs[bs]
        graph.replay()
        # Out of the shared pool before any other graph replays (stream order), into pinned memory.
        self.pcm_host[:n].copy_(pcm[:n], non_blocking=True)
        self.valid_host[:n].copy_(valid[:n], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.pending = Pending(self, n, done)
        return self.pending

    def decode(self, tokens: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """tokens [n, rows, C] int64, keys [n] int64 → PCM16 [n, S], valid [n] (n ≤ max_batch)."""
        return self.launch(tokens, keys).result()


class Pending:
    """A launched decode: `result()` waits for it and reads it out (once; later calls return the
    same arrays). Eager decodes are `later`: computed when first read, so an urgent group read
    first is not kept waiting by the groups launched after it."""

    def __init__(self, graphs: DetokGraphs | None, n: int, done, compute=None) -> None:
        self.graphs, self.n, self.done, self.compute = graphs, n, done, compute
        self.out: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def later(cls, compute: Callable[[], tuple[np.ndarray, np.ndarray]]) -> Pending:
        """A decode run by `compute()` when the result is first asked for (the eager path)."""
        return cls(None, 0, None, compute)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self.out is None:
            if self.compute is not None:
                self.out = self.compute()
                return self.out
            g = self.graphs
            try:
                self.done.synchronize()
                self.out = g.pcm_host[: self.n].numpy().copy(), g.valid_host[: self.n].numpy().copy()
            finally:  # read or failed: either way the next launch may use the buffers
                if g.pending is self:
                    g.pending = None
        return self.out
