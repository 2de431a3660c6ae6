"""CUDA graph capture, shared by the gpu_worker's and the codec_worker's graphs.

torch is imported inside `capture`, so that importing common/ never loads torch: only the GPU-side
processes that capture graphs pay for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def capture(step: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm up `step` on a side stream (kernel selection and JIT happen outside the capture), then
    capture it into `pool` (a `torch.cuda.graph_pool_handle()`); → (graph, its output, rewritten in
    place by each replay)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
