"""The prompt lanes on the GPU (Qwen3-TTS 1.7B CustomVoice, dummy weights, bf16, as served: fused
layers, graphs; two lanes): prompts that arrive while a step is in flight start in the lanes, each
on a stream of its own beside that step and beside each other, and a request's frames, greedy and
sampled, equal its frames alone (where it starts in a step of its own), also when prompts start
while the host waits for a step's results (`Engine.on_wait`, as the worker runs it). The report
holds how many started in a lane, how many lanes ran at once and how long the host took to launch
one.
"""

from __future__ import annotations

import time

import pytest
import torch

from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gpu_worker.engine import Engine
from tokenizer_worker.worker import wire_array

MODEL = "qwen3-tts"


@pytest.fixture(scope="module")
def lane():
    from gpu_worker.runner.sampler import use_tail_kernel
    from programs import get_spec, load_program_class

    prog = load_program_class(MODEL)(
        get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16
    )
    prog.load_lm()
    assert prog.fuse_layers() and use_tail_kernel(True)
    settings = GpuWorkerSettings(max_batch_size=64, max_context=1024, prompt_lane="on", prompt_lanes=2)
    eng = Engine(prog, settings)
    assert len(eng.runner.lanes) == 2
    yield prog, eng
    use_tail_kernel(False)


def test_frames_started_in_the_lanes_equal_those_alone(lane, gpu_report):
    prog, eng = lane
    launch_ms: list[float] = []
    timed = eng.runner.launch_lane

    def launch(req, lane):
        t0 = time.perf_counter()
        try:
            return timed(req, lane)
        finally:
            launch_ms.append(1000 * (time.perf_counter() - t0))

    eng.runner.launch_lane = launch

    def prompt(rid: str, text: str, seed: int, temperature: float, new: int = 40) -> Prompt:
        built = prog.preprocess(text, {})
        rows = built.rows.astype("<i4")
        sp = SamplingParams(
            temperature=temperature, top_k=50, seed=seed, max_tokens=len(rows) + new, min_tokens=new
        )
        state = {k: wire_array(v) for k, v in built.state.items()}
        return Prompt(rid, rows.tobytes(), len(rows), sp, state=state)

    # Steps after each arrival: a prompt that arrives with no step after the one before finds that
    # one's lane still busy and takes the other.
    gaps = (1, 0, 2, 0, 1, 0)
    most = [0]  # the most lanes in flight at once

    def turn() -> None:
        eng.lane_step()
        most[0] = max(most[0], len(eng._lanes))

    def generate(order: list[Prompt]) -> dict:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            turn()  # a step in flight: the prompt starts beside it
            for _ in range(gaps[i % len(gaps)]):
                eng.step()
                turn()
        while eng.has_work():
            eng.step()
            turn()
        return {rid: rows for rid, (rows, _) in eng.outputs.items()}

    def generate_while_waiting(order: list[Prompt]) -> dict:
        """The worker's way with the lanes (`Engine.on_wait`): a prompt arrives during each wait
        of the host for a step's results and starts in a free lane then."""
        eng.outputs = {}
        pending, waited = list(order[1:]), [None]

        def on_wait() -> None:
            if pending and eng._waiting is not waited[0]:
                waited[0] = eng._waiting
                eng.add(pending.pop(0))
            turn()

        eng.add(order[0])
        eng.on_wait = on_wait
        try:
            while pending or eng.has_work():
                eng.step()
                turn()
        finally:
            eng.on_wait = None
        return {rid: rows for rid, (rows, _) in eng.outputs.items()}

    def diffs(got: dict, alone: dict) -> dict:
        return {
            rid: next((i for i, (a, b) in enumerate(zip(got[rid], alone[rid], strict=True)) if a != b), None)
            for rid in alone
        }

    def serialized(req, lane):  # the lane alone on the device: nothing runs beside it
        torch.cuda.synchronize()
        out = launch(req, lane)
        torch.cuda.synchronize()
        return out

    report = gpu_report("qwen3-tts-prompt-lane")
    first_diff, variants = {}, {}
    for temperature in (0.0, 0.9):
        texts = [f"Request {i} says a sentence of its own." for i in range(6)]
        order = [prompt(f"r{i}", t, 10 + i, temperature) for i, t in enumerate(texts)]
        alone = {}
        for p in order:
            alone |= generate([p])
        eng.runner.lane_on = False  # the same arrivals, every prompt in a step
        variants[f"T={temperature} lane off"] = diffs(generate(order), alone)
        eng.runner.lane_on = True
        eng.runner.launch_lane = serialized
        variants[f"T={temperature} lane serialized"] = diffs(generate(order), alone)
        eng.runner.launch_lane = launch
        own = [pl.stream for pl in eng.runner.lanes]
        for pl in eng.runner.lanes:  # the lanes' work in the steps' order
            pl.stream = torch.cuda.current_stream()
        variants[f"T={temperature} lanes on the steps' stream"] = diffs(generate(order), alone)
        for pl, stream in zip(eng.runner.lanes, own, strict=True):
            pl.stream = stream
        eng.runner.num_lanes = 1  # one lane: a prompt that finds it busy waits
        variants[f"T={temperature} one lane"] = diffs(generate(order), alone)
        eng.runner.num_lanes = 2
        before = eng.lane_prompts
        waiting = diffs(generate_while_waiting(order), alone)
        variants[f"T={temperature} prompts while the host waits"] = waiting
        first_diff |= {f"T={temperature} {rid} (while the host waits)": d for rid, d in waiting.items()}
        report[f"T={temperature} prompts_started_in_a_lane_while_waiting"] = eng.lane_prompts - before
        assert eng.lane_prompts > before, "no prompt started in a lane while the host waited"
        before = eng.lane_prompts
        most[0] = 0
        got = generate(order)
        started = eng.lane_prompts - before
        report[f"T={temperature} lanes_in_flight_most"] = most[0]
        report[f"T={temperature} prompts_started_in_a_lane"] = f"{started} of {len(order)}"
        first_diff |= {f"T={temperature} {rid}": d for rid, d in diffs(got, alone).items()}
        assert started >= len(order) // 2, f"only {started} of {len(order)} prompts started in a lane"
        assert most[0] == 2, "no prompt started beside another lane's"
    report["frames_lane_vs_alone_first_difference"] = first_diff
    report["variants_first_difference"] = variants
    report["lane_launch_ms_p50"] = sorted(launch_ms)[len(launch_ms) // 2]
    assert first_diff == dict.fromkeys(first_diff, None)
