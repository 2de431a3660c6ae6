"""Qwen3-TTS on the GPU (dummy 1.7B CustomVoice weights, bf16): graphs against eager, and the talker
against the reference's where it imports, one engine for every check.

1. Code predictor graphs: the captured `decode_tokens` (15 codebooks + sampler) against the eager
   call for the same talker states, greedy and sampled, at several batch sizes: frames equal.
2. Talker, teacher-forced: codebook-0 logits from the graph runner against the eager runner, and
   the eager runner's against the reference talker's (`Qwen3TTSTalkerModel` and `codec_head` of
   qwen-tts-compat, same weights, bf16) over the same input rows: within bf16 tolerance.
3. Greedy frames of a request alone and among 3 and 17 others joining at different steps, in both
   text modes (the streaming one reads its text from the per-request state inside the graphs).
4. Sampled frames with every step's sampling in its bucket's graph (prompt steps too) against
   the same requests sampled eagerly: equal.
5. Decode step time with graphs (talker + code predictor) per batch size, context 300.

Each runs with the layers as served by default and with `--fused-step on`, and the 0.6B
CustomVoice's talker (another shape) with `--fused-step on`.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from parity_checks import bf16_engines, decode_step_ms, forced_steps, rows_for, where_for

from common.messages import Prompt, SamplingParams
from programs.base import Rows
from tokenizer_worker.worker import wire_array

FRAME_MS = 80.0
MODEL = "qwen3-tts"


@pytest.fixture(scope="module", params=["eager", "fused", "fused-0.6b"])
def qwen(request):
    """(program, engine, eager runner): the layers as served by default, then with --fused-step on
    (FlashInfer's fused layers, the predictor's depth-attention kernel and the sampler's Triton
    tail), then the 0.6B model's with it; each writes a report of its own."""
    fused = request.param.startswith("fused")
    model = "qwen3-tts-0.6b" if request.param.endswith("0.6b") else MODEL
    yield (*bf16_engines(model, fused=fused), f"{model}-parity" + ("-fused-step" if fused else ""))
    if fused:
        from gpu_worker.runner.sampler import use_tail_kernel

        use_tail_kernel(False)


def test_code_predictor_graphs_give_the_eager_frames(qwen, gpu_report):
    prog, eng, eager, report = qwen
    gen = torch.Generator(device="cuda").manual_seed(0)
    differ = {}
    for bs in (1, 3, 8, 64):
        hidden = torch.randn(bs, prog.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        c0 = torch.randint(0, 2048, (bs,), generator=gen, device="cuda")
        for temp in (0.0, 0.9):
            rows, where = rows_for(bs, temp, 100 * bs), where_for(bs, 16)
            g = eng.runner.forward_runner.decode_tokens(hidden, c0, rows, where).clone()
            e = eager.decode_tokens(hidden, c0, rows, where)
            differ[f"batch {bs} temperature {temp}"] = int((g != e).sum())
    gpu_report(report)["predictor_graph_vs_eager_differing_codes"] = differ
    assert differ == dict.fromkeys(differ, 0)


def _reference_talker(prog):
    """The reference's talker model and codec head with the program's weights, or None where
    qwen-tts-compat does not import here."""
    try:
        from tests.qwen3_tts_reference import reference_module

        if "librosa" not in sys.modules:
            try:
                import librosa  # noqa: F401
            except ImportError:  # the talker never calls it (the speaker encoder's mel does)
                sys.modules["librosa"] = types.ModuleType("librosa")
        mod = reference_module()
        from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSTalkerConfig
    except (ImportError, pytest.skip.Exception):
        return None
    talker = mod.Qwen3TTSTalkerForConditionalGeneration(Qwen3TTSTalkerConfig(**prog.lm.talker_config))
    talker.load_state_dict(prog.lm.state_dict(), strict=True)
    return talker.to(device="cuda", dtype=torch.bfloat16).eval()


def test_talker_logits_match_eager_and_the_reference(qwen, gpu_report):
    prog, eng, eager, report = qwen
    rng = np.random.default_rng(0)
    prompts = [
        prog.preprocess(t, {}).rows for t in ("Hello there.", "A longer sentence to speak, with commas.")
    ]
    steps = forced_steps(prompts, rng.integers(0, 2048, size=(24, 16)))
    lg = torch.stack(
        [eng.runner.forward_runner.forward(s)[0][:, 0].float().cpu() for s in steps]
    )  # [T, B, V']
    le = torch.stack([eager.forward(s)[0][:, 0].float().cpu() for s in steps])
    d = (lg - le).abs()
    res = gpu_report(report)
    res["talker_graph_vs_eager"] = {
        "max_abs": float(d.max()),
        "ref_abs_max": float(le.abs().max()),
        "top1_agree": float((lg.argmax(-1) == le.argmax(-1)).float().mean()),
    }
    assert res["talker_graph_vs_eager"]["max_abs"] < 1e-2
    talker = _reference_talker(prog)
    if talker is None:
        res["talker_vs_reference"] = "qwen-tts-compat does not import on this machine"
        return
    with torch.no_grad():  # request 0's rows, whole sequence at once, through the reference
        x = torch.cat(
            [torch.from_numpy(prompts[0].astype(np.int64))] + [torch.from_numpy(s.ids[:1]) for s in steps[1:]]
        )
        n = len(x)
        where = Rows(torch.zeros(n, dtype=torch.int64), torch.arange(n) - len(prompts[0]))
        emb = prog.embed(x.cuda(), Rows(where.slot.cuda(), where.step.cuda()))[None]  # [1, N, H]
        out = talker(inputs_embeds=emb, attention_mask=torch.ones(1, n, dtype=torch.long, device="cuda"))
        ref = out.logits[0][:, prog.head_ids].float().cpu()  # [N, V']: the prefill pass over every row
    ours = le[:, 0]  # [T, V'] request 0: the prompt's last row, then one row per frame
    want = ref[len(prompts[0]) - 1 :]
    dr = (ours - want).abs()
    res["talker_vs_reference"] = {
        "max_abs": float(dr.max()),
        "ref_abs_max": float(want.abs().max()),
        "top1_agree": float((ours.argmax(-1) == want.argmax(-1)).float().mean()),
    }
    assert res["talker_vs_reference"]["top1_agree"] >= 0.9 and float(dr.max()) < 0.1 * float(want.abs().max())


def test_greedy_frames_alone_equal_those_among_others(qwen, gpu_report):
    prog, eng, _, report = qwen

    def prompt(rid: str, text: str, seed: int, new: int = 60, mode: str = "true") -> Prompt:
        built = prog.preprocess(text, {"non_streaming_mode": mode})
        rows = built.rows.astype("<i4")
        sp = SamplingParams(temperature=0.0, seed=seed, max_tokens=len(rows) + new, min_tokens=new)
        state = {k: wire_array(v) for k, v in built.state.items()}
        return Prompt(rid, rows.tobytes(), len(rows), sp, state=state)

    def generate(order: list[Prompt]) -> list:
        eng.outputs = {}
        for i, p in enumerate(order):
            eng.add(p)
            for _ in range(i % 3):
                eng.step()  # join a batch already decoding
        eng.run_until_idle()
        return eng.outputs["x"][0]

    first_diff = {}
    for mode in ("true", "false"):
        alone = generate([prompt("x", "The same words, spoken again and again.", 1, mode=mode)])
        for n_others in (3, 17):
            others = [
                prompt(f"o{i}", "other text " * (1 + i % 5), 100 + i, 40 + 3 * i, ("true", "false")[i % 2])
                for i in range(n_others)
            ]
            x = prompt("x", "The same words, spoken again and again.", 1, mode=mode)
            got = generate([*others[: n_others // 2], x, *others[n_others // 2 :]])
            first_diff[f"non_streaming_mode {mode}, {n_others} others"] = next(
                (i for i, (a, b) in enumerate(zip(got, alone, strict=True)) if a != b), None
            )
    gpu_report(report)["greedy_alone_vs_batched_first_difference"] = first_diff
    assert first_diff == dict.fromkeys(first_diff, None)


def test_sampling_graphs_draw_the_eager_sampler_frames(qwen, gpu_report):
    """Sampled frames (the model's temperature and top-k, codebooks 1..15 drawn in the depth step)
    of requests starting at different steps, every step sampled in its bucket's sampling graph
    (prompt steps too), against the same requests sampled eagerly: equal."""
    prog, eng, _, report = qwen
    graphs = eng.runner.sample_graphs
    assert graphs is not None, "a multi-codebook program samples in graphs"

    def run(sampled_in_graphs: bool) -> tuple[dict, int, int]:
        eng.runner.sample_graphs = graphs if sampled_in_graphs else None
        steps, replays = eng.step_count, [0]
        replay = graphs.replay

        def counted(bs: int, constrained: bool):
            replays[0] += 1
            return replay(bs, constrained)

        graphs.replay = counted
        try:
            eng.outputs = {}
            for i in range(6):
                built = prog.preprocess("words to speak, number " + "one " * (1 + i), {})
                rows = built.rows.astype("<i4")
                sp = SamplingParams(
                    temperature=0.9, top_k=50, seed=7 + i, max_tokens=len(rows) + 30, min_tokens=30
                )
                state = {k: wire_array(v) for k, v in built.state.items()}
                eng.add(Prompt(f"s{i}", rows.tobytes(), len(rows), sp, state=state))
                eng.step()
            eng.run_until_idle()
            return {k: v[0] for k, v in eng.outputs.items()}, eng.step_count - steps, replays[0]
        finally:
            graphs.replay = replay
            eng.runner.sample_graphs = graphs

    in_graphs, steps, replayed = run(True)
    eager, _, replayed_eagerly = run(False)
    differ = {rid: sum(a != b for a, b in zip(in_graphs[rid], eager[rid], strict=True)) for rid in eager}
    gpu_report(report)["sampling_graphs_vs_eager_differing_frames"] = differ
    assert replayed_eagerly == 0 and replayed == steps  # every step, those with prompts too
    assert differ == dict.fromkeys(differ, 0)


def test_decode_step_time(qwen, gpu_report):
    prog, eng, _, report = qwen
    step_ms = decode_step_ms(eng, 16)
    res = gpu_report(report)
    res["decode_step_ms_context_300"] = step_ms
    assert step_ms[1] < FRAME_MS
