"""Which attention backend a runner gets: the one place that names them all.

Torch on CPU; FlashInfer on GPU, with decode steps on FlashInfer or XQA (`--decode-attention`,
resolved by `gpu_worker.attention.xqa.resolve_decode_attention` from the GPU, the cache's dtype and
its shape). Prefill rows always run on FlashInfer.
"""

from __future__ import annotations

import torch

from gpu_worker.attention.interface import EagerAttention, GraphAttentionBackend
from gpu_worker.attention.xqa import resolve_decode_attention
from gpu_worker.runner.kv_cache import pages_for
from programs.base import LMProgram


def eager_attention(program: LMProgram, kv_cache: torch.Tensor, limits) -> EagerAttention:
    """The attention of an eager runner: torch on CPU, FlashInfer on GPU."""
    if program.device.type == "cpu":
        from gpu_worker.attention.torch_paged import TorchPagedAttention

        return TorchPagedAttention(kv_cache, program.num_qo_heads)
    return _flashinfer(program, kv_cache, limits, resolve_decode_attention(limits.decode_attention, kv_cache))


def graph_attention(
    program: LMProgram, kv_cache: torch.Tensor, limits, max_batch: int, max_pages: int, sequences: int = 1
) -> tuple[EagerAttention, GraphAttentionBackend]:
    """(the eager attention of steps no graph holds, the graphs' backend) on FlashInfer, decode
    graphs on the resolved decode kernel; `max_batch` rows and `max_pages` page indices at most in a
    decode graph; `sequences` KV sequences a request (each at a slot of its own)."""
    from gpu_worker.attention.flashinfer import FlashInferGraphs

    decode = resolve_decode_attention(limits.decode_attention, kv_cache)
    eager = _flashinfer(program, kv_cache, limits, decode)
    args = (program, kv_cache, max_batch, max_pages, limits.decode_tensor_cores, limits.no_split_kv)
    if decode == "xqa":
        from gpu_worker.attention.xqa import XqaDecode, XqaGraphs

        # each slot's pages (a sequence's whole budget) as a row of XQA's table
        per_request = pages_for(limits.max_context + 1, kv_cache.shape[3])
        xqa = XqaDecode(kv_cache, sequences * limits.max_batch_size, per_request, max_batch)
        return eager, XqaGraphs(xqa, FlashInferGraphs(*args))
    return eager, FlashInferGraphs(*args)


def _flashinfer(program: LMProgram, kv_cache: torch.Tensor, limits, decode: str) -> EagerAttention:
    from gpu_worker.attention.flashinfer import FlashInferAttention

    return FlashInferAttention(
        kv_cache, program.num_qo_heads, program.dtype, limits.decode_tensor_cores, decode, limits.no_split_kv
    )
