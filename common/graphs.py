"""CUDA graph capture, shared by the gpu_worker's and the codec_worker's graphs. Imports torch, so
only GPU-side processes import it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(step: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm up `step` on a side stream (kernel selection and JIT happen outside the capture), then
    capture it into `pool`; → (graph, its output, rewritten in place by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
