"""The model on the device: the `ModelRunner` (model_runner.py: KV cache, sampling slots, a step's
layout, launch, sampling and its host copy, device timing), the forward runners it drives (eager.py;
graphs.py with prefill_graphs.py, depth_graphs.py and sample_graphs.py for CUDA graphs, reading the
input arena of arena.py), and the sampler (sampler.py, slots.py)."""
