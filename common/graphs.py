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


def capture(step: Callable[[], T], pool: Any, stream: Any = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Warm up `step` on a side stream (kernel selection and JIT happen outside the capture), then
    capture it into `pool` (a `torch.cuda.graph_pool_handle()`); → (graph, its output, rewritten in
    place by each replay).

    `stream`: the stream to capture on (default: torch's one capture stream). A captured GEMM keeps
    the cuBLAS workspace of the stream it was captured on, so graphs that may replay at the same
    time on different streams (gpu_worker/runner/prompt_lane.py) are captured on different ones."""
    import torch

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = step()
    return graph, out
