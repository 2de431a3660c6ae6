"""Does work beside a step change what it samples? Qwen3-TTS 1.7B (dummy, bf16, fused), lane off:
six staggered requests' frames against each alone, while a stressor replays on a stream of its
own the whole time. Stressors:

  none      nothing beside the steps (the control)
  gemm      a graph of large GEMMs on tensors of its own (no memory shared with the steps):
            contention alone
  sampling  the prompt lane's one-row sampling graph on the scratch slot (meta all scratch): the
            lane's kernels, touching only the scratch slot's records

    python bench/lane_diagnostics/contention.py none|gemm|sampling

A difference under `gemm` means a step's kernels round differently when they share the SMs
(then the codec worker beside the LM under MPS would do it too); only under `sampling`, memory the
lane's graph and the steps' share."""

import sys
import threading

import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from gpu_worker.runner.sampler import use_tail_kernel
from programs import get_spec, load_program_class
from tokenizer_worker.worker import wire_array

mode = sys.argv[1]
prog = load_program_class("qwen3-tts")(
    get_spec("qwen3-tts"), load_format="dummy", device="cuda", dtype=torch.bfloat16
)
prog.load_lm()
prog.fuse_layers()
use_tail_kernel(True)
eng = Engine(
    prog,
    GpuWorkerSettings(max_batch_size=64, max_context=1024, prompt_lane="on" if mode == "sampling" else "off"),
)
eng.runner.lane_on = False  # every prompt in a step


def prompt(rid, text, seed, temperature, new=40):
    built = prog.preprocess(text, {})
    rows = built.rows.astype("<i4")
    sp = SamplingParams(
        temperature=temperature, top_k=50, seed=seed, max_tokens=len(rows) + new, min_tokens=new
    )
    return Prompt(
        rid, rows.tobytes(), len(rows), sp, state={k: wire_array(v) for k, v in built.state.items()}
    )


def generate(order):
    eng.outputs = {}
    for i, p in enumerate(order):
        eng.add(p)
        for _ in range(1 + i % 3):
            eng.step()
    eng.run_until_idle()
    return {rid: rows for rid, (rows, _) in eng.outputs.items()}


stream = torch.cuda.Stream(priority=-1)
if mode == "gemm":
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(20):
            a = torch.nn.functional.linear(a, w) * 1e-3
    stress = g.replay
elif mode == "sampling":
    lane = eng.runner.lane
    lane.meta.zero_()
    lane.meta[0].fill_(eng.runner.slots.scratch)
    graph, _ = lane.samples[False]
    stress = graph.replay
else:
    stress = None

stop = threading.Event()


def run():
    with torch.cuda.stream(stream):
        while not stop.is_set():
            stress()
            stream.synchronize()


for temperature in (0.0, 0.9):
    order = [
        prompt(f"r{i}", f"Request {i} says a sentence of its own.", 10 + i, temperature) for i in range(6)
    ]
    alone = {}
    for p in order:
        alone |= generate([p])
    t = threading.Thread(target=run, daemon=True) if stress else None
    if t:
        stop.clear()
        t.start()
    got = generate(order)
    if t:
        stop.set()
        t.join()
    d = {
        rid: next((i for i, (x, y) in enumerate(zip(got[rid], alone[rid])) if x != y), None) for rid in alone
    }
    print(f"{mode} T={temperature}: first differences {d}", flush=True)
