"""Qwen3-TTS Base on the GPU (dummy 1.7B Base weights, bf16 LM, float32 encoders): voice cloning.

1. The encoders (ECAPA-TDNN speaker encoder, the 12 Hz tokenizer's Mimi encoder) on the GPU against
   the same encoders on the CPU, clips of 3-10 s in one batch: speaker vectors within 1e-3 of their
   scale, codes equal but for near ties (at least 99%); the time of one batch of 8 clips.
2. Greedy frames of a cloned request (ICL streaming and non-streaming text, x-vector only) alone
   equal those among 3 and 17 others with other voices and modes joining at different steps: the
   speaker vector and the clip's frames are read from per-request state inside the graphs. Where
   a case differs, the report says where its keys and values first differ; engines without one
   suspect each (one decode bucket; XQA decode attention) tell which one rounds by batch.
3. A codec stream primed with a clip's frames (3 s and 30 s), then decoded a window at a time
   through the codec graphs, equals the whole decode of clip and frames, the clip cut off; the
   report has the first chunk's time (the prime's cost).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from common.config import GpuWorkerSettings
from common.messages import DetokChunk, Finished, FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import Reference, Voice, pcm16
from tokenizer_worker.worker import wire_array

MODEL = "qwen3-tts-base"
REPORT = "qwen3-tts-base-clone"


def _clip(seconds: float, seed: int) -> Reference:
    n = int(24000 * seconds)
    t = np.arange(n) / 24000
    g = np.random.default_rng(seed)
    tone = 0.3 * np.sin(2 * np.pi * (100 + 30 * seed) * t) * (1 + 0.5 * np.sin(2 * np.pi * 2 * t))
    audio = np.clip(tone + 0.05 * g.standard_normal(n), -1, 1).astype(np.float32)
    return Reference(audio, f"Reference clip number {seed}, spoken slowly.")


@pytest.fixture(scope="module")
def base():
    """(program, engine, voices)."""
    prog = load_program_class(MODEL)(
        get_spec(MODEL), load_format="dummy", device="cuda", dtype=torch.bfloat16
    )
    prog.load_lm()
    prog.load_encoders()
    clips = [_clip(3 + i, i) for i in range(8)]
    voices = [Voice(f, c.text) for f, c in zip(prog.encode_references(clips), clips, strict=True)]
    return prog, Engine(prog, GpuWorkerSettings(max_batch_size=64, max_context=1024)), voices


def test_a_primed_codec_stream_continues_its_clip_on_the_gpu(base, gpu_report):
    """Chunk 0 with a clip's frames as its prefix (3 s and 30 s: 38 and 375 frames), then 12 frames
    a window each through the codec graphs (the prime eager before them, on the same stream):
    the PCM equals `decode_all` of clip + frames with the clip's samples cut, within 2 LSB (float32
    codec). The report has each first chunk's time (the prime and its window)."""
    prog, _, _ = base
    prog.load_codec()
    codec = Codec(prog, max_batch=16, graphs=True, streams=17)
    rng = np.random.default_rng(3)
    res = {}
    for seconds in (3, 30):
        clip = rng.integers(0, 2048, size=(int(seconds * 12.5), 16)).astype("<i4")
        frames = rng.integers(0, 2048, size=(12, 16)).astype("<i4")
        rid = f"clip-{seconds}s"
        chunks = [DetokChunk(rid, i, 0, frames[i : i + 1].tobytes(), i) for i in range(len(frames))]
        chunks[0].prefix = clip.tobytes()
        torch.cuda.synchronize()
        start = time.perf_counter()
        audio = codec.decode(chunks[:1])
        first_ms = 1000 * (time.perf_counter() - start)
        audio += codec.decode(chunks[1:])  # a round per window: one request's chunks in order
        codec.ended([Finished(rid, FinishReason.STOP)])
        got = np.concatenate([np.frombuffer(a.pcm, dtype="<i2") for a in audio]).astype(np.int32)
        whole = prog.codec.decode_all(torch.from_numpy(np.concatenate([clip, frames])).long().cuda())
        want = pcm16(whole).cpu().numpy().astype(np.int32)[len(clip) * 1920 :]
        res[f"{seconds} s clip"] = {
            "first_chunk_ms": first_ms,
            "max_pcm_diff_vs_whole_decode": int(np.abs(got - want).max()),
        }
    gpu_report(REPORT)["primed_codec_stream"] = res
    assert all(r["max_pcm_diff_vs_whole_decode"] <= 2 for r in res.values()), res


def test_gpu_encoders_equal_the_cpu_encoders(base, gpu_report):
    prog, _, _ = base
    clips = [_clip(3 + i, i) for i in range(8)]
    prog.encode_references(clips)  # warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    gpu = prog.encode_references(clips)
    torch.cuda.synchronize()
    res = gpu_report(REPORT)
    res["encode_ms_8_clips_3_to_10_s"] = 1000 * (time.perf_counter() - start)
    cpu_prog = load_program_class(MODEL)(get_spec(MODEL), load_format="dummy")
    cpu_prog.load_encoders()
    # dummy weights are drawn on each device: the CPU encoders take the GPU encoders' weights
    for name in ("speaker", "codes"):
        mine = getattr(prog._encoders, name).state_dict()
        getattr(cpu_prog._encoders, name).load_state_dict({k: v.cpu() for k, v in mine.items()})
    cpu = cpu_prog.encode_references(clips[:2])
    scale = max(float(np.abs(c["speaker"]).max()) for c in cpu)
    res["speaker_max_abs_diff"] = max(
        float(np.abs(g["speaker"] - c["speaker"]).max()) for g, c in zip(gpu[:2], cpu, strict=True)
    )
    res["speaker_scale"] = scale
    res["codes_equal_fraction"] = float(
        np.mean([(g["codes"] == c["codes"]).mean() for g, c in zip(gpu[:2], cpu, strict=True)])
    )
    assert [len(g["codes"]) for g in gpu] == [-(-len(c.audio) // 1920) for c in clips]
    assert res["speaker_max_abs_diff"] < 1e-3 * scale
    assert res["codes_equal_fraction"] >= 0.99  # a near tie between two codes may round either way


MODES = [{}, {"non_streaming_mode": "true"}, {"x_vector_only_mode": "true"}]
TEXT = "The same words, spoken again and again."


def _prompt(prog, voices, rid: str, text: str, voice: int, opts: dict, new: int = 60) -> Prompt:
    built = prog.preprocess(text, opts, voices[voice])
    rows = built.rows.astype("<i4")
    sp = SamplingParams(temperature=0.0, max_tokens=len(rows) + new, min_tokens=new)
    state = {k: wire_array(v) for k, v in built.state.items()}
    return Prompt(rid, rows.tobytes(), len(rows), sp, state=state)


def _others(prog, voices, n: int) -> list[Prompt]:
    return [
        _prompt(prog, voices, f"o{i}", "other text " * (1 + i % 5), 1 + i % 7, MODES[i % 3], 40 + 3 * i)
        for i in range(n)
    ]


def _generate(eng: Engine, order: list[Prompt]) -> tuple[np.ndarray, torch.Tensor]:
    """Request "x"'s frames [T, 16] among `order` (each joining after i % 3 steps), and its keys and
    values position by position [L, 2, n, Hkv, D] (n = its prompt and fed-back frames), read from
    its KV pages once every request has ended (no request is admitted after it, so nobody writes
    them again)."""
    pages: list[int] = []
    start = eng.scheduler.start

    def note_pages(req, got: list[int]) -> None:  # where "x"'s keys and values go
        if req.rid == "x":
            pages[:] = got
        start(req, got)

    eng.scheduler.start = note_pages
    try:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
    finally:
        del eng.scheduler.start
    frames = np.array(eng.outputs["x"][0])
    n = next(p.n_rows for p in order if p.rid == "x") + len(frames) - 1
    kv = eng.kv_cache[:, pages]  # [L, P, 2, page, Hkv, D]
    kv = kv.permute(0, 2, 1, 3, 4, 5).flatten(2, 3)[:, :, :n]
    return frames, kv.clone()


def _first_difference(alone: tuple, got: tuple, prompt_rows: int) -> dict | None:
    """Where "x" among others first differs from "x" alone: the first frame (and its codebooks that
    differ), and the first position whose keys or values differ in any layer (and the lowest such
    layer): in the prompt (its prefill rounded otherwise), or the fed-back frame t at position
    prompt_rows + t (the decode step that wrote it rounded otherwise); None when all are equal."""
    (fa, ka), (fg, kg) = alone, got
    frame = next((t for t, (a, b) in enumerate(zip(fa, fg, strict=False)) if (a != b).any()), None)
    if frame is None and len(fa) != len(fg):
        frame = min(len(fa), len(fg))
    n = min(ka.shape[2], kg.shape[2])
    differs = (ka[:, :, :n] != kg[:, :, :n]).flatten(3).any(-1).any(1)  # [L, n]
    at = differs.any(0).nonzero()
    if frame is None and not len(at):
        return None
    out: dict = {"first_frame": frame, "prompt_rows": prompt_rows}
    if frame is not None and frame < min(len(fa), len(fg)):
        out["codebooks_at_first_frame"] = np.nonzero(fa[frame] != fg[frame])[0].tolist()
    if len(at):
        pos = int(at[0])
        out["kv_position"] = pos
        out["kv_in"] = "prompt" if pos < prompt_rows else f"fed-back frame {pos - prompt_rows}"
        out["kv_lowest_layer"] = int(differs[:, pos].nonzero()[0])
    return out


@pytest.mark.xfail(
    reason="FlashInfer's decode kernels round a row by its batch's graph bucket on the H200: on tensor "
    "cores the non-streaming ICL request among 17 others differs from frame 57 on, on CUDA cores the "
    "streaming ICL one from frame 24; XQA or one decode bucket make the first equal",
    strict=False,
)
def test_cloned_greedy_frames_alone_equal_those_among_others(base, gpu_report):
    """Besides the first differing frame f, each case records where "x"'s keys and values first
    differ (`_first_difference`), read before the frames do (a position before prompt_rows + f):
    in the prompt → its prefill; at a fed-back frame's position in layer 0 → that decode step's
    embedding or K/V projection (the decode bucket's GEMMs); in a deeper layer only → its attention
    or a deeper GEMM. At prompt_rows + f (frame f itself differs) → nothing stored rounded otherwise
    before: the step that sampled frame f did, in its last layer, the head (codebook 0 among the
    differing codebooks) or the code predictor (codebooks 1..15 alone: the depth graphs)."""
    prog, eng, voices = base
    first_diff, where = {}, {}
    for m, opts in enumerate(MODES):
        x = _prompt(prog, voices, "x", TEXT, 0, opts)
        alone = _generate(eng, [x])
        for n_others in (3, 17):
            others = _others(prog, voices, n_others)
            got = _generate(eng, [*others[: n_others // 2], x, *others[n_others // 2 :]])
            case = f"mode {m} {opts}, {n_others} others"
            where[case] = _first_difference(alone, got, x.n_rows)
            first_diff[case] = None if where[case] is None else where[case]["first_frame"]
    res = gpu_report(REPORT)
    res["greedy_alone_vs_batched_first_difference"] = first_diff
    res["greedy_alone_vs_batched_where"] = where
    assert first_diff == dict.fromkeys(first_diff, None)


# Engines that each take one suspect away: every decode (and depth) step in one bucket of 32 rows,
# so the GEMMs see one row count alone and among others; decode attention on XQA, which never
# splits a request's KV over thread blocks (FlashInfer splits KV past 128 tokens, in chunks sized
# by the whole batch's lengths, when its split is on).
SUSPECTS = {
    "one decode bucket (--min-decode-batch 32)": dict(min_decode_batch=32),
    "XQA decode attention (--decode-attention xqa)": dict(decode_attention="xqa"),
    "FlashInfer decode on CUDA cores": dict(decode_tensor_cores=False),
}


def test_what_rounds_the_non_streaming_icl_case_by_batch(base, gpu_report):
    """The non-streaming ICL case (prompt 92 rows: the only case whose context passes 128 tokens)
    alone and among 17 others, on an engine per suspect: the suspect whose engine makes it equal
    is what rounds by batch (the report records each engine's `_first_difference`). Fails when
    neither does: the cause is elsewhere (a prefill lane, the depth graphs)."""
    prog, _, voices = base
    where = {}
    x = _prompt(prog, voices, "x", TEXT, 0, MODES[1])
    others = _others(prog, voices, 17)
    for name, settings in SUSPECTS.items():
        try:  # an engine that cannot be built here says so in the report; the other still runs
            eng = Engine(prog, GpuWorkerSettings(max_batch_size=32, max_context=512, **settings))
        except Exception as e:
            where[name] = f"no such engine here: {type(e).__name__}: {e}"
            continue
        alone = _generate(eng, [x])
        where[name] = _first_difference(alone, _generate(eng, [*others[:8], x, *others[8:]]), x.n_rows)
        del eng
        torch.cuda.empty_cache()
    gpu_report(REPORT)["non_streaming_icl_17_others_by_suspect"] = where
    assert None in where.values(), where
