"""Higgs Audio v2 on the GPU (dummy 3B weights, bf16): graphs against eager, and the backbone against
the reference's where transformers builds it, one engine for every check.

1. `decode_tokens` graphs (codebooks 1..7 + sampler + the delay pattern's forced ids) against the
   eager call, for the same hidden states and previous rows (bos rows, an eos countdown, flush
   rows), greedy and sampled, at several batch sizes: rows equal.
2. Backbone, teacher-forced over a prompt then audio rows (DualFFN's text and audio paths):
   codebook-0 logits from the graph runner against the eager runner, and the eager runner's against
   transformers' `HiggsAudioV2ForConditionalGeneration` (same weights, bf16) over the same rows.
   A decode step (the audio path only, `Rows.prompt_rows` 0) against the same step with both paths
   on every row: logits equal.
3. Greedy rows of a request alone and among 3 and 17 others joining at different steps, with the
   decode graphs' GEMMs in tiles of 64 rows (`--decode-row-tile 64`): the same. As one GEMM a step,
   bf16 GEMMs round a row by the batch from a row count that depends on the GPU (on an H100 among
   17 others the rows part from the 5th): reported.
4. Codec stream graphs against the eager codec, and against the whole utterance's decode: 16 streams
   of delay-pattern rows, one row a window, interleaved; the time of one codec call per batch size.
5. Decode step time with graphs per batch size: one stream's step fits in a frame (40 ms); the
   largest batch that does (an LM-side bound on real-time streams) is reported.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from parity_checks import bf16_engines, decode_step_ms, forced_steps, rows_for

from codec_worker.worker import Codec
from common.config import GpuWorkerSettings
from common.messages import DetokChunk, Finished, FinishReason, Prompt, SamplingParams
from gpu_worker.attention.interface import StepLayout
from gpu_worker.engine import Engine
from programs.base import Rows
from programs.higgs_tts import spec as h

FRAME_MS = 40.0
MODEL = "higgs-tts"


@pytest.fixture(scope="module")
def higgs():
    """(program, engine, eager runner)."""
    return bf16_engines(MODEL)


def delayed(frames: np.ndarray, end: bool, flush: int) -> np.ndarray:
    """Frames [T, 8] → the delay pattern's rows: the all-bos row, codebook k lagging k rows, then
    (`end`) the eos countdown, the all-eos row and `flush` - 1 flush rows (the stop row left out)."""
    t = len(frames)
    rows = np.full((t + 8, 8), h.STREAM_BOS, dtype=np.int64)
    for k in range(8):
        rows[k + 1 : k + 1 + t, k] = frames[:, k]
        rows[k + 1 + t :, k] = h.FORCED_EOS
    if not end:
        return rows
    tail = np.full((flush, 8), h.FORCED_EOS, dtype=np.int64)
    tail[1:, 0] = h.FLUSH_BASE + np.arange(1, flush)
    return np.concatenate([rows, tail])


def test_decode_tokens_graphs_give_the_eager_rows(higgs, gpu_report):
    prog, eng, eager = higgs
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_all = torch.from_numpy(delayed(np.random.default_rng(0).integers(0, 1024, (30, 8)), True, 4)).cuda()
    differ = {}
    for bs in (1, 3, 8, 64):
        hidden = torch.randn(bs, prog.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        c0 = torch.randint(0, h.CODEBOOK_IDS, (bs,), generator=gen, device="cuda")
        step = torch.randint(
            0, len(rows_all), (bs,), generator=gen, device="cuda"
        )  # bos rows, countdown, flush
        i64 = dict(dtype=torch.int64, device="cuda")
        where = Rows(torch.arange(bs, **i64), step, rows_all[(step - 1).clamp(min=0)])
        for temp in (0.0, 0.9):
            rows = rows_for(bs, temp, 100 * bs)
            window = prog._recent.clone()  # decode_tokens writes its row into the slots' RAS window
            g = eng.runner.forward_runner.decode_tokens(hidden, c0, rows, where).clone()
            prog._recent.copy_(window)  # the eager call sees the window the graph saw
            e = eager.decode_tokens(hidden, c0, rows, where)
            differ[f"batch {bs} temperature {temp}"] = int((g != e).sum())
    gpu_report("higgs-tts-parity")["decode_tokens_graph_vs_eager_differing_codes"] = differ
    assert differ == dict.fromkeys(differ, 0)


def _reference(prog):
    """transformers' model with the program's weights (bf16, cuda), or None where it does not build."""
    try:
        from tests.higgs_tts_reference import reference_lm

        return reference_lm(prog.lm, "cuda", torch.bfloat16)
    except (ImportError, TypeError, ValueError) as e:
        return f"transformers' Higgs Audio v2 does not build here: {e}"


def test_backbone_logits_match_eager_and_the_reference(higgs, gpu_report):
    prog, eng, eager = higgs
    prompts = [
        prog.preprocess(t, {}).rows for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    rows = delayed(np.random.default_rng(0).integers(0, 1024, (24, 8)), False, 0)
    steps = forced_steps(prompts, rows)
    lg = torch.stack(
        [eng.runner.forward_runner.forward(s)[0][:, 0].float().cpu() for s in steps]
    )  # [T, B, V]
    le = torch.stack([eager.forward(s)[0][:, 0].float().cpu() for s in steps])
    d = (lg - le).abs()
    res = gpu_report("higgs-tts-parity")
    res["backbone_graph_vs_eager"] = {
        "max_abs": float(d.max()),
        "ref_abs_max": float(le.abs().max()),
        "top1_agree": float((lg.argmax(-1) == le.argmax(-1)).float().mean()),
    }
    # bf16: the graphs' fused projections and batched GEMMs round apart from the eager layers (on
    # the H200, 0.19 over logits up to 5.0; Orpheus's graphs, 0.20 over 6.4)
    assert res["backbone_graph_vs_eager"]["max_abs"] < 0.05 * res["backbone_graph_vs_eager"]["ref_abs_max"]
    assert res["backbone_graph_vs_eager"]["top1_agree"] >= 0.9
    ref = _reference(prog)
    if isinstance(ref, str):
        res["backbone_vs_reference"] = ref
        return
    with torch.no_grad():  # request 0: its prompt, then a placeholder per audio row, in one pass
        n = len(prompts[0])
        ids = np.concatenate([prompts[0][:, 0], np.full(len(rows), 128016)])
        out = ref(
            input_ids=torch.from_numpy(ids.astype(np.int64))[None].cuda(),
            audio_input_ids=torch.from_numpy(np.minimum(rows, h.STREAM_EOS))[None].cuda(),
            audio_input_ids_mask=torch.ones(1, len(rows), dtype=torch.bool, device="cuda"),
        )
        want = out.logits[0].float().view(len(ids), h.N_CODEBOOKS, h.CODEBOOK_IDS)[n - 1 :, 0].cpu()
    ours = le[:, 0]  # [T, V] request 0: the prompt's last row, then one row per audio row
    dr = (ours - want).abs()
    res["backbone_vs_reference"] = {
        "max_abs": float(dr.max()),
        "ref_abs_max": float(want.abs().max()),
        "top1_agree": float((ours.argmax(-1) == want.argmax(-1)).float().mean()),
    }
    assert res["backbone_vs_reference"]["top1_agree"] >= 0.9 and float(dr.max()) < 0.1 * float(
        want.abs().max()
    )


def test_a_decode_step_gives_the_logits_of_both_paths_on_every_row(higgs, gpu_report):
    """The eager runner's decode step (audio path only) against the same step with no split given
    (both feed-forward paths on every row, the flag from each row's step keeping its own): the same
    fused audio GEMMs on the same rows, so the same bits."""
    prog, _, eager = higgs
    prompts = [prog.preprocess(t, {}).rows for t in ("Hello there.", "A second prompt, a longer one.")]
    steps = forced_steps(prompts, delayed(np.random.default_rng(2).integers(0, 1024, (4, 8)), False, 0))
    for s in steps[:-1]:
        eager.forward(s)
    b = steps[-1]
    split = eager.forward(b)[0]
    where, pos = torch.from_numpy(b.where).cuda(), torch.from_numpy(b.pos).cuda()
    eager.attn.plan(StepLayout(b.qo_indptr, b.kv_lens, b.page_tables, pos))
    with torch.inference_mode():
        emb = prog.embed(torch.from_numpy(b.ids).cuda(), Rows(where[:, 0], where[:, 1]))
        both = prog.head(prog.backbone(emb, pos, eager.attn)).float()
    differ = int((split != both).sum())
    gpu_report("higgs-tts-parity")["decode_step_audio_path_vs_both_paths_differing_logits"] = differ
    assert differ == 0


def test_greedy_rows_alone_equal_those_among_others(higgs, gpu_report):
    prog, untiled, _ = higgs

    def prompt(rid: str, text: str, seed: int, new: int = 60) -> Prompt:
        rows = prog.preprocess(text, {}).rows.astype("<i4")
        sp = SamplingParams(temperature=0.0, seed=seed, max_tokens=len(rows) + new)
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    def generate(eng: Engine, order: list[Prompt]) -> list:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        return eng.outputs["x"][0]

    def first_differences(eng: Engine) -> dict:
        alone = generate(eng, [prompt("x", "The same words, spoken again and again.", 1)])
        first_diff = {}
        for n_others in (3, 17):
            others = [
                prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 40 + 3 * i) for i in range(n_others)
            ]
            x = prompt("x", "The same words, spoken again and again.", 1)
            got = generate(eng, [*others[: n_others // 2], x, *others[n_others // 2 :]])
            first_diff[n_others] = next(
                (i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None
            )
        return first_diff

    report = gpu_report("higgs-tts-parity")
    report["greedy_alone_vs_batched_first_difference"] = first_differences(untiled)
    tiled = Engine(prog, GpuWorkerSettings(max_batch_size=64, max_context=1024, decode_row_tile=64))
    try:
        got = report["greedy_alone_vs_batched_first_difference_row_tiles_of_64"] = first_differences(tiled)
    finally:
        del tiled  # its KV cache and graphs, before the next test's codec slots
        gc.collect()
        torch.cuda.empty_cache()
    assert got == dict.fromkeys(got, None)


def test_codec_stream_graphs_match_the_eager_codec_and_the_whole_decode(higgs, gpu_report):
    """16 streams of 12 frames (their delay-pattern rows, the all-eos row and the flush rows), one row
    a window, each round of windows decoded in two calls: stream graphs against the eager decode,
    and both against `decode_all` of each stream's frames (one Codec after the other: each
    allocates the program's codec slots anew)."""
    prog, _, _ = higgs
    prog.load_codec()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # float32 convolutions as such: the decodes compared round alike
    try:
        res, rows = _codec_checks(prog)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    codec = Codec(prog, max_batch=64, graphs=True, streams=65)
    call_ms = {}
    for bs in (1, 16, 64):
        batch = [DetokChunk(f"t{bs}-{b}", 0, 0, rows[b % 16, :1].tobytes(), 0) for b in range(bs)]
        for _ in range(3):
            codec.decode(batch)
            batch = [DetokChunk(c.rid, c.index + 1, 0, c.tokens, c.index + 1) for c in batch]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            codec.decode(batch)
            batch = [DetokChunk(c.rid, c.index + 1, 0, c.tokens, c.index + 1) for c in batch]
        call_ms[bs] = (time.perf_counter() - t0) * 100
        codec.ended([Finished(c.rid, FinishReason.STOP) for c in batch])  # their slots freed
    res["codec_call_ms_one_row_windows"] = call_ms
    gpu_report("higgs-tts-parity")["codec"] = res
    assert res["max_pcm_diff_graphs_vs_eager"] <= 1 and res["max_pcm_diff_stream_vs_whole_decode"] <= 2, res


def _codec_checks(prog) -> tuple[dict, np.ndarray]:
    """The PCM differences of the stream graphs against the eager codec and the whole decode, and
    the streams' rows."""
    frames = np.random.default_rng(1).integers(0, 1024, size=(16, 12, 8))
    rows = np.stack([delayed(f, True, prog.flush_rows) for f in frames]).astype("<i4")
    n = rows.shape[1]
    chunks = [DetokChunk(f"s{b}", i, 0, rows[b, i : i + 1].tobytes(), i) for i in range(n) for b in range(16)]
    pcm = {}
    for graphs in (True, False):
        codec = Codec(prog, max_batch=16, graphs=graphs, streams=17)
        assert bool(codec.graphs) == graphs
        audio: dict[str, list[np.ndarray]] = {}
        for lo in range(0, len(chunks), 8):
            for a in codec.decode(chunks[lo : lo + 8]):
                audio.setdefault(a.rid, []).append(np.frombuffer(a.pcm, dtype="<i2"))
        pcm[graphs] = np.stack([np.concatenate(audio[f"s{b}"]) for b in range(16)]).astype(np.int32)
    assert pcm[True].shape == (16, 12 * h.SAMPLES_PER_FRAME)
    whole = np.stack(
        [
            (prog.codec.decode_all(torch.from_numpy(f).cuda()).clamp(-1, 1) * 32767)
            .to(torch.int16)
            .cpu()
            .numpy()
            for f in frames
        ]
    ).astype(np.int32)
    res = {
        "max_pcm_diff_graphs_vs_eager": int(np.abs(pcm[True] - pcm[False]).max()),
        "max_pcm_diff_stream_vs_whole_decode": int(np.abs(pcm[True] - whole).max()),
    }
    return res, rows


def test_one_streams_decode_step_fits_in_a_frame(higgs, gpu_report):
    _, eng, _ = higgs
    step_ms = decode_step_ms(eng, h.N_CODEBOOKS)
    res = gpu_report("higgs-tts-parity")
    res["decode_step_ms_context_300"] = step_ms
    res["lm_bound_streams_real_time"] = max((bs for bs, ms in step_ms.items() if ms < FRAME_MS), default=0)
    assert step_ms[1] < FRAME_MS
