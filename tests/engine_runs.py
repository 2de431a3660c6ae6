"""Running prompts through an Engine the way several tests do: requests joining a batch that is
already decoding, and the same engine with the graph runner in place of the eager one."""

from __future__ import annotations

from common.config import GpuWorkerSettings
from common.messages import Prompt
from gpu_worker.engine import Engine
from programs.base import LMProgram


def staggered(eng: Engine, batch: list[Prompt], every: int = 0) -> dict:
    """Request i joins after i steps (i mod `every` with every > 0) → the engine's outputs."""
    eng.outputs = {}
    for i, p in enumerate(batch):
        eng.add(p)
        for _ in range(i % every if every else i):
            eng.step()  # later requests join a batch that is already decoding
    eng.run_until_idle()
    return eng.outputs


def graph_engine(program: LMProgram, graph_runner_cls, limits: dict) -> Engine:
    """An Engine whose forward runner is `graph_runner_cls` (tests/test_graph_runner_replays_match_
    eager_on_cpu.py: the GPU graph runner with CPU stand-ins for graphs)."""
    eng = Engine(program, GpuWorkerSettings(**limits))
    eng.runner.forward_runner = graph_runner_cls(program, eng.kv_cache, GpuWorkerSettings(**limits))
    return eng
