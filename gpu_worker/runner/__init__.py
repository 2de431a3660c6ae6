"""The model on the device: the `ModelRunner` (model_runner.py: KV cache, sampling slots, a step's
layout, launch, sampling and its host copy, device timing), the forward runners it drives (eager.py;
graphs.py with prefill_graphs.py, depth_graphs.py and sample_graphs.py for CUDA graphs, reading the
input arena of arena.py; prompt_lane.py beside them), and the sampler (sampler.py, slots.py).

A captured GEMM keeps the cuBLAS workspace it was captured with. cuBLAS's is one per stream, but
torch gives cuBLASLt one per device unless told to share cuBLAS's: the prompt lane's graphs replay
beside the steps' on a stream of their own, so this process asks for the per-stream one before any
GEMM runs."""

import os

os.environ.setdefault("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
