"""The codec_worker process: batches ready chunks across requests and turns them into PCM16.

Everything drained in one pass is decoded together (in batches of at most `max_codec_batch`), and
each request's `Finished` is forwarded after its chunks, so the gateway sees a request's audio
complete before its end.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from common.config import ServeConfig, program_kwargs, resolve_device
from common.ipc import PullChannel, PushChannel
from common.messages import (
    AudioChunk,
    AudioChunks,
    CodecInMsg,
    DetokBatch,
    DetokChunk,
    Finished,
    FinishReason,
    GatewayInMsg,
    ProcState,
)
from common.proc import StatusReporter
from programs import get_spec, load_program_class, rng
from programs.base import LMProgram, pcm16

log = logging.getLogger(__name__)


class Codec:
    """The program's detokenizer over batches of wire chunks (no sockets: testable alone). On a GPU
    it replays captured graphs per batch bucket unless `graphs` is False."""

    def __init__(self, program: LMProgram, max_batch: int = 64, graphs: bool = True, progress=None) -> None:
        self.program = program
        self.max_batch = max_batch
        self.device = program.device
        self.graphs = None
        if graphs and self.device.type == "cuda":
            from codec_worker.graphs import DetokGraphs

            self.graphs = DetokGraphs(program, max_batch, progress)

    @torch.inference_mode()
    def _decode_eager(self, tokens: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        audio, valid = self.program.detokenize(
            torch.from_numpy(tokens).to(self.device), torch.from_numpy(keys).to(self.device)
        )  # [Bd, S], [Bd]
        return pcm16(audio).cpu().numpy(), valid.cpu().numpy()

    def decode(self, chunks: list[DetokChunk]) -> list[AudioChunk]:
        out: list[AudioChunk] = []
        p = self.program
        run = self.graphs.decode if self.graphs is not None else self._decode_eager
        for lo in range(0, len(chunks), self.max_batch):
            part = chunks[lo : lo + self.max_batch]
            rows = np.stack([np.frombuffer(c.tokens, dtype="<i4") for c in part]).astype(np.int64)
            seeds = torch.tensor([c.seed for c in part], dtype=torch.int64)
            index = torch.tensor([c.noise_id for c in part], dtype=torch.int64)
            keys = rng.mix_keys(seeds, index).numpy()  # [Bd] noise key per chunk
            pcm, valid = run(rows.reshape(len(part), p.detok_interval, p.n_codebooks), keys)
            for c, samples, ok in zip(part, pcm.astype("<i2"), valid, strict=True):
                out.append(AudioChunk(c.rid, c.index, samples.tobytes() if ok else b""))
        return out


class CodecWorker:
    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        device = resolve_device(cfg.codec_device if cfg.codec_device != "auto" else cfg.device)
        if device.startswith("cuda"):
            # TF32 convolutions drift ~5e-4 from fp32 and vary with the batch size; keep fp32 exact
            # so a chunk decodes the same alone or batched.
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(spec, device=device, **program_kwargs(cfg))
        status.set(ProcState.LOADING, f"loading {spec['name']} codec on {device}")
        program.load_codec()
        self.codec = Codec(
            program,
            graphs=not cfg.disable_cuda_graph,
            progress=lambda msg: status.set(ProcState.LOADING, msg),
        )
        self.status = status
        self.inbox: PullChannel[CodecInMsg] = PullChannel(cfg.addresses.codec_in, CodecInMsg, bind=True)
        self.to_gateway: PushChannel[GatewayInMsg] = PushChannel(cfg.addresses.gateway_in)

    def run(self) -> None:
        while True:
            batches = self.inbox.drain(timeout_ms=100)
            if not batches:
                continue
            chunks = [c for b in batches for c in b.chunks]
            finished = [f for b in batches for f in b.finished]
            try:
                audio = self.codec.decode(chunks)
            except Exception as e:
                # A codec failure fails these requests, not the process.
                log.exception("codec failed on %d chunks", len(chunks))
                self._fail(batches, f"codec error: {type(e).__name__}: {e}")
                continue
            self.to_gateway.send(AudioChunks(chunks=audio, finished=finished))

    def _fail(self, batches: list[DetokBatch], message: str) -> None:
        rids = {c.rid for b in batches for c in b.chunks} | {f.rid for b in batches for f in b.finished}
        fails = [Finished(rid, FinishReason.ERROR, message=message, status=500) for rid in sorted(rids)]
        self.to_gateway.send(AudioChunks(chunks=[], finished=fails))
