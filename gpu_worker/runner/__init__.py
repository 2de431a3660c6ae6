"""The model on the device: the `ModelRunner` (model_runner.py: KV cache, sampling slots, a step's
layout, launch, sampling and its host copy, device timing), the forward runners it drives (eager.py;
graphs.py with prefill_graphs.py, depth_graphs.py and sample_graphs.py for CUDA graphs, reading the
input arena of arena.py; prompt_lane.py beside them), and the sampler (sampler.py, slots.py).

A captured GEMM keeps the cuBLAS workspace it was captured with, one per stream. The prompt lane's
graphs replay beside the steps' on a stream of their own, so before any GEMM runs this process asks
torch to give cuBLASLt's GEMMs that per-stream workspace too (TORCH_CUBLASLT_UNIFIED_WORKSPACE),
whatever its default for them."""

import os

os.environ.setdefault("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
