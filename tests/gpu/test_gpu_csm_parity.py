"""CSM on the GPU (dummy csm-1b weights, bf16): graphs against eager, one engine for every check
(its GraphRunner captures prefill, decode and depth graphs once).

1. Depth graphs: the captured `decode_tokens` (depth decoder + sampler) against the eager call, for
   the same backbone states, greedy and sampled, at several batch sizes: frames equal.
2. Backbone, teacher-forced: codebook-0 logits from the graph runner against the eager runner.
3. Greedy frames of a request alone and among 3 and 17 others joining at different steps.
4. Codec stream graphs against the eager codec: 16 streams of one-frame windows, interleaved.
5. Decode step time with graphs (backbone + depth) per batch size: one stream's step fits in a frame
   (80 ms); the largest batch that does (an LM-side bound on real-time streams) is reported.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_checks import bf16_engines, decode_step_ms, rows_for, where_for

from codec_worker.worker import Codec
from common.messages import DetokChunk, Prompt, SamplingParams
from gpu_worker.runner.batch import StepBatch

PAGE = 16
FRAME_MS = 80.0


def forced_steps(prompts: list[np.ndarray], frames: np.ndarray) -> list[StepBatch]:
    """Step 0 prefills every prompt; step t feeds frame t-1 to every request."""
    n = len(prompts)
    per = 1 + (max(len(p) for p in prompts) + len(frames)) // PAGE
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(n)]
    lens = [len(p) for p in prompts]
    ids = np.concatenate(prompts).astype(np.int64)
    pos = np.concatenate([np.arange(k) for k in lens])
    steps = [StepBatch(ids, pos, [0, *np.cumsum(lens).tolist()], list(lens), tables, n)]
    for t in range(1, len(frames) + 1):
        ids = np.repeat(frames[t - 1][None].astype(np.int64), n, axis=0)
        pos = np.array([k + t - 1 for k in lens], dtype=np.int64)
        steps.append(StepBatch(ids, pos, list(range(n + 1)), [k + t for k in lens], tables, 0))
    return steps


@pytest.fixture(scope="module")
def csm():
    """(program, engine, eager runner)."""
    return bf16_engines("csm")


def test_depth_graphs_give_the_eager_frames(csm, gpu_report):
    prog, eng, eager = csm
    gen = torch.Generator(device="cuda").manual_seed(0)
    depth = {}
    for bs in (1, 3, 8, 64):
        hidden = torch.randn(bs, prog.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        c0 = torch.randint(0, 2048, (bs,), generator=gen, device="cuda")
        for temp in (0.0, 0.9):
            rows = rows_for(bs, temp, 100 * bs)
            where = where_for(bs, prog.n_codebooks)
            g = eng.runner.forward_runner.decode_tokens(hidden, c0, rows, where).clone()
            e = eager.decode_tokens(hidden, c0, rows, where)
            depth[f"batch {bs} temperature {temp}"] = int((g != e).sum())
    gpu_report("csm-parity")["depth_graph_vs_eager_frames_differing_codes"] = depth
    assert depth == dict.fromkeys(depth, 0)


def test_backbone_graph_logits_match_eager(csm, gpu_report):
    prog, eng, eager = csm
    rng = np.random.default_rng(0)
    prompts = [
        prog.preprocess(t, {"voice": "0"})
        for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    steps = forced_steps(prompts, rng.integers(0, 2048, size=(32, 32)))
    lg = torch.stack(
        [eng.runner.forward_runner.forward(s)[0][:, 0].float().cpu() for s in steps]
    )  # [T, B, V]
    le = torch.stack([eager.forward(s)[0][:, 0].float().cpu() for s in steps])
    d = (lg - le).abs()
    res = {
        "max_abs": float(d.max()),
        "ref_abs_max": float(le.abs().max()),
        "top1_agree": float((lg.argmax(-1) == le.argmax(-1)).float().mean()),
    }
    gpu_report("csm-parity")["backbone_graph_vs_eager"] = res
    assert res["max_abs"] < 1e-2


def test_greedy_frames_alone_equal_those_among_others(csm, gpu_report):
    """Graphs on; min_tokens masks the stop code, so every request runs its whole budget."""
    prog, eng, _ = csm

    def prompt(rid: str, text: str, seed: int, new: int = 60) -> Prompt:
        rows = prog.preprocess(text, {"voice": str(seed % 10)}).astype("<i4")
        sp = SamplingParams(temperature=0.0, seed=seed, max_tokens=len(rows) + new, min_tokens=new)
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    def generate(order: list[Prompt]) -> list:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        return eng.outputs["x"][0]

    alone = generate([prompt("x", "The same words, again.", 1)])
    batched = {}
    for n_others in (3, 17):
        others = [prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 40 + 3 * i) for i in range(n_others)]
        got = generate(
            [*others[: n_others // 2], prompt("x", "The same words, again.", 1), *others[n_others // 2 :]]
        )
        batched[n_others] = next((i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None)
    gpu_report("csm-parity")["greedy_alone_vs_batched_first_difference"] = batched
    assert batched == dict.fromkeys(batched, None)


def test_codec_stream_graphs_match_the_eager_codec(csm, gpu_report):
    """16 streams of 6 frames, one frame a window, each round of windows decoded in two calls:
    the codec's stream graphs against its eager decode (one Codec after the other: each allocates
    the program's codec slots anew)."""
    prog, _, _ = csm
    prog.load_codec()
    frames = np.random.default_rng(1).integers(0, 2048, size=(16, 6, 32)).astype("<i4")
    chunks = [
        DetokChunk(f"s{b}", i, 0, frames[b, i : i + 1].tobytes(), i) for i in range(6) for b in range(16)
    ]
    pcm = {}
    for graphs in (True, False):
        codec = Codec(prog, max_batch=16, graphs=graphs, streams=16)
        assert bool(codec.graphs) == graphs
        audio: dict[str, list[np.ndarray]] = {}
        for lo in range(0, len(chunks), 8):
            for a in codec.decode(chunks[lo : lo + 8]):
                audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
        pcm[graphs] = np.stack([np.concatenate(audio[f"s{b}"]) for b in range(16)]).astype(np.int32)
    assert pcm[True].shape == (16, 6 * 1920)
    res = {"max_pcm_diff": int(np.abs(pcm[True] - pcm[False]).max())}
    gpu_report("csm-parity")["codec_stream_graphs_vs_eager"] = res
    assert res["max_pcm_diff"] <= 1, res


def test_one_streams_decode_step_fits_in_a_frame(csm, gpu_report):
    _, eng, _ = csm
    step_ms = decode_step_ms(eng, 32)
    res = gpu_report("csm-parity")
    res["decode_step_ms_context_300"] = step_ms
    res["lm_bound_streams_real_time"] = max((bs for bs, ms in step_ms.items() if ms < FRAME_MS), default=0)
    assert step_ms[1] < FRAME_MS
