"""The gpu_worker process: owns the LM program and the engine, and runs the step loop.

It takes prompts from the gateway's dispatcher on `gpu_in` (several gpu_workers can share one
gateway): after each step it announces its free capacity (`credits`, from the engine's scheduler:
free slots, bounded by the KV pages a full-budget request needs), so it is only ever sent prompts it can start at once. Aborts
arrive on the same socket, broadcast to every gpu_worker."""

from __future__ import annotations

import logging
import math
import time

import torch

from common.config import GpuWorkerSettings, ServeConfig, program_kwargs, resolve_device
from common.ipc import PushChannel
from common.late_imports import LateImports, describe
from common.messages import Abort, Appends, CodecInMsg, GpuInMsg, ProcState, Prompt
from common.pool import CreditWorkChannel
from common.proc import StatusReporter
from gpu_worker.engine import Engine
from gpu_worker.runner.sampler import use_tail_kernel
from gpu_worker.stages import StageReporter
from gpu_worker.stall import StallWatch
from programs import get_spec, load_program_class
from programs.base import LMProgram
from programs.blocks import fp8

log = logging.getLogger(__name__)

METRICS_S = 0.05
SLOW_LOG_S = 1.0  # at most one slow-step line a second
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def codec_lane(cfg: ServeConfig, device: str, program: LMProgram) -> bool:
    """Whether the codec worker decodes first and second chunks in its first lane: with
    `--codec-first-lane`, its graphs, on a GPU (`device`: this gpu_worker's, the codec's by default),
    for a `program` without codec streams (codec_worker/codec.py captures the lane for no other)."""
    codec_device = device if cfg.codec.device == "auto" else cfg.codec.device
    return (
        cfg.codec.first_lane
        and cfg.codec.cuda_graphs
        and codec_device.startswith("cuda")
        and not program.codec_streams
    )


def engine_limits(cfg: ServeConfig, spec: dict, device: str) -> GpuWorkerSettings:
    """The engine's settings: the worker's, with the batch size and context that default to the
    device's and the model's (`GpuWorkerSettings.resolved`)."""
    return cfg.gpu.resolved(device, spec["max_tokens"])


class GpuWorker:
    def __init__(self, cfg: ServeConfig, status: StatusReporter) -> None:
        assert cfg.addresses is not None
        device = resolve_device(cfg.device)
        spec = get_spec(cfg.model)
        program = load_program_class(cfg.model)(
            spec,
            device=device,
            dtype=resolve_dtype(cfg.gpu.dtype, device),
            lm_head=cfg.gpu.head_for(device),
            quantization=cfg.gpu.quantization,
            **program_kwargs(cfg),
        )
        status.set(ProcState.LOADING, f"loading {spec['name']} LM on {device}")
        program.load_lm()
        if cfg.gpu.invariant_gemm == "on":
            if not device.startswith("cuda"):
                log.warning("--invariant-gemm runs on a CUDA GPU: the CPU's GEMMs stay torch's")
            elif not fp8.use_invariant_gemm(True):
                raise RuntimeError("--invariant-gemm on needs Triton, which does not import here")
        if cfg.gpu.fused_step == "on":
            fused = program.fuse_layers()
            sampler_kernel = device.startswith("cuda") and use_tail_kernel(True)
            log.info("--fused-step on: fused layers %s, sampler kernel %s", fused, sampler_kernel)
        limits = engine_limits(cfg, spec, device)
        status.set(ProcState.LOADING, "allocating KV cache")
        self.engine = Engine(
            program, limits, progress=lambda msg: status.set(ProcState.LOADING, msg),
            codec_lane=codec_lane(cfg, device, program),
            lane_room=cfg.codec.first_lane_room,
        )  # fmt: skip
        log.info(
            "engine ready: %s on %s, batch %d, context %d, %d KV pages of %d",
            spec["name"],
            device,
            limits.max_batch_size,
            limits.max_context,
            self.engine.allocator.num_pages,
            limits.page_size,
        )
        self.status = status
        self.inbox: CreditWorkChannel[GpuInMsg] = CreditWorkChannel(
            cfg.addresses.gpu_in, GpuInMsg, name=status.name, uncounted=(Abort, Appends)
        )
        self.to_codec: PushChannel[CodecInMsg] = PushChannel(cfg.addresses.codec_in)
        self.stages = StageReporter()  # tap-only events: admitted, first token
        # With the prompt lanes, the host's waits for a step take prompts and lanes' turns
        # (`while_waiting`); what else arrives meanwhile waits here for the next drain.
        self._deferred: list[GpuInMsg] = []
        self._waited_on = None  # the step of the last wait `while_waiting` ran in
        if self.engine.runner.lane_on:
            self.engine.on_wait = self.while_waiting
        self._metrics_at = 0.0
        self._slow_seen = self._slow_logged = 0  # slow steps seen and logged (`report_slow`)
        self._slow_log_at = -SLOW_LOG_S
        # Where a slow step's thread was (the GPU, where slow steps are recorded): gpu_worker/stall.py
        self.watch = StallWatch() if math.isfinite(self.engine.slow_step_s) else None

    def run(self) -> None:
        engine = self.engine
        late = LateImports()  # what startup loaded: an import from here on waits inside a step
        while True:
            # 0. say how many more prompts this worker can start now
            self.inbox.offer(self.credits())
            # 1. take what arrived
            self.receive()
            # 2-3. schedule and run one step
            watch = self.watch
            if watch is not None:
                watch.begin()
            try:
                out = engine.step()
            except Exception as e:
                self.failed(e)
                continue
            finally:
                stack = watch.end() if watch is not None else ""
            # 4. emit one message for the step
            self.emit(out)
            imported = late.check()
            if imported:
                log.warning(
                    "step %d imported %s: import them at startup", engine.step_count, describe(imported)
                )
            if engine.slow_steps != self._slow_seen:
                self.report_slow(stack)
            self.lane()
            # The gauges (the capacity estimate among them) at most every METRICS_S: heartbeats
            # carry the latest, a few per second, so computing them every step is wasted work.
            now = time.monotonic()
            metrics = None
            if now - self._metrics_at >= METRICS_S:
                metrics, self._metrics_at = engine.metrics(), now
            self.status.set_load(engine.num_active, engine.limits.max_batch_size, metrics)

    def report_slow(self, stack: str = "") -> None:
        """Log a step past the engine's SLOW_STEP_S with its parts, at most once every SLOW_LOG_S
        (the line counts those not logged since): a stall, its cause named by the part it is in,
        and by where the loop thread was once the step had run STALL_AFTER_S (`stack`)."""
        engine = self.engine
        self._slow_seen = engine.slow_steps
        now = time.monotonic()
        if now - self._slow_log_at < SLOW_LOG_S:
            return
        unlogged = engine.slow_steps - self._slow_logged - 1
        self._slow_log_at, self._slow_logged = now, engine.slow_steps
        parts = ", ".join(f"{k} {v}" for k, v in (engine.slow_step or {}).items())
        more = f" ({unlogged} more since the last line)" if unlogged else ""
        log.warning("slow step (ms): %s%s%s", parts, more, f"; the thread was at {stack}" if stack else "")

    def failed(self, e: Exception) -> None:
        """After a failed step: every request in flight ends with an explicit error rather than a
        hang. A CUDA error leaves the context unusable: then exit and let the supervisor restart us."""
        engine = self.engine
        log.exception("step failed; failing %d requests", engine.num_active)
        engine.fail_all(f"gpu_worker step failed: {type(e).__name__}: {e}")
        out = engine.step()
        if out is not None:
            self.to_codec.send(out)
        if isinstance(e, torch.cuda.CudaError) or "CUDA" in str(e):
            raise e

    def emit(self, out) -> None:
        """A step's one message to the codec worker (if it made any), and the tap's stage events."""
        self.stages.publish(self.engine)
        if out is not None:
            self.to_codec.send(out)

    def lane(self) -> None:
        """The prompt lanes' turn (`Engine.lane_step`): the first rows of those that ended out at
        once, waiting prompts into the free ones."""
        if not self.engine.runner.lane_on:
            return
        try:
            out = self.engine.lane_step()
        except Exception as e:
            self.failed(e)
            return
        self.emit(out)

    def receive(self) -> None:
        """Drain the inbox: block briefly only when idle, or 2 ms when every running request sat
        the last step out (streams past --max-lead, open input waiting for text); with
        --late-launch, go on taking messages until the step in flight is about to end
        (`Engine.hold_s`), so that what arrives meanwhile joins the next step. With the prompt
        lanes, each drain is followed by their turn (`lane`)."""
        engine = self.engine
        deferred, self._deferred = self._deferred, []
        self.take(deferred)
        wait_ms = (0 if engine.scheduler.last_batch_size else 2) if engine.has_work() else 50
        self.take(self.inbox.drain(timeout_ms=wait_ms))
        self.lane()
        if not engine.late:
            return
        t0 = time.perf_counter()
        while engine.hold_s() >= 0.001:  # in drains of 1 ms: the step may end sooner than expected
            self.take(self.inbox.drain(timeout_ms=1))
            self.lane()
        if engine.scheduler.last_batch_size:
            engine.held(time.perf_counter() - t0)

    def while_waiting(self) -> None:
        """While the host waits for a step on the device (`Engine.on_wait`): prompts that arrived
        start in a free lane, and a lane whose step ended sends its first rows, at once rather than
        after the step. Aborts and appended text wait for the next drain (`_deferred`): they
        change requests of the steps in flight; so does everything after them, in arrival order
        (a new gateway's `Abort(everything)` comes before its first prompts, which it must not
        end). A failure propagates to the step's caller."""
        engine, taken = self.engine, []
        for msg in self.inbox.drain():
            if isinstance(msg, Prompt) and not self._deferred:
                taken.append(msg)
            else:
                self._deferred.append(msg)
        self.take(taken)
        # The lanes' turn when something came for it, and once a wait (prompts the step left
        # waiting may fit a lane): this runs again and again meanwhile.
        first = engine.waiting_on is not self._waited_on
        self._waited_on = engine.waiting_on
        if taken or first or engine.lane_ended():
            out = engine.lane_step()
            if out is not None:  # the tap's stage events with it (admissions carry their own time)
                self.emit(out)

    def take(self, msgs: list[GpuInMsg]) -> None:
        """The inbox's messages into the engine: a bad one ends its request, never the worker."""
        engine = self.engine
        for msg in msgs:
            try:
                match msg:
                    case Prompt():
                        engine.add(msg)
                    case Appends():
                        engine.append(msg)
                    case Abort(rids=rids, everything=everything):
                        if everything:
                            engine.abort_all()
                        for rid in rids:
                            engine.abort(rid)
                    case _:
                        raise TypeError(f"unexpected message {type(msg).__name__}")
            except Exception as e:
                log.exception("could not take %s", type(msg).__name__)
                if isinstance(msg, Prompt):
                    engine.reject(msg.rid, f"gpu_worker could not take the prompt: {e}")

    def credits(self) -> int:
        """Prompts this worker can start at once, as its scheduler says (`Scheduler.credits`)."""
        return self.engine.credits()
