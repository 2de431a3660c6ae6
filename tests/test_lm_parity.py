"""The gpu_worker engine generates exactly what transformers' LlamaForCausalLM.generate does for the
same random weights (CPU fp32, greedy), alone and inside a batch of requests of other lengths;
and sampled requests do not depend on their batch."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import GpuWorkerSettings
from common.messages import FinishReason, Prompt, SamplingParams
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class

SPEC = get_spec("orpheus-tiny")
STOP = SPEC["stop_tokens"][0]


@pytest.fixture(scope="module")
def program():
    p = load_program_class("orpheus-tiny")(SPEC, load_format="dummy")
    p.load_lm()
    return p


@pytest.fixture(scope="module")
def hf_model(program):
    path = os.path.join(os.path.dirname(__import__("programs.orpheus", fromlist=["x"]).__file__), "configs")
    with open(os.path.join(path, SPEC["lm_config"])) as f:
        cfg = LlamaConfig(**json.load(f))
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(program.lm.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def recording_engine(program, **limits) -> Engine:
    eng = Engine(program, GpuWorkerSettings(**limits))
    eng.outputs = {}
    return eng


def generated(eng: Engine, rid: str) -> list[int]:
    tokens, reason = eng.outputs[rid]
    return tokens + ([STOP] if reason == FinishReason.STOP else [])


def run(engine: Engine, prompts: list[Prompt], stagger: bool = False) -> None:
    for i, p in enumerate(prompts):
        engine.add(p)
        if stagger:  # later requests join a batch that is already decoding
            for _ in range(i + 1):
                engine.step()
    engine.run_until_idle()


def make_prompt(rid: str, ids: list[int], max_tokens: int, **sp) -> Prompt:
    rows = np.array(ids, dtype="<i4")
    return Prompt(rid, rows.tobytes(), len(rows), SamplingParams(max_tokens=max_tokens, **sp))


PROMPTS = {
    "a": [128259, 128000, 40, 1093, 5, 128009, 128260, 128261, 128257],
    "b": [128259, 128000, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 128009, 128260, 128261, 128257],
    "c": [128000, 33, 34],
    "d": [128259, 128000] + list(range(200, 240)) + [128009, 128260, 128261, 128257],
}


def hf_generate(model, ids: list[int], max_tokens: int, penalty: float) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_length=max_tokens,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=STOP,
            pad_token_id=STOP,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_tokens_equal_transformers_alone_and_in_a_batch(program, hf_model, penalty):
    max_tokens = {"a": 40, "b": 60, "c": 25, "d": 70}
    want = {rid: hf_generate(hf_model, ids, max_tokens[rid], penalty) for rid, ids in PROMPTS.items()}
    sp = dict(temperature=0.0, repetition_penalty=penalty)
    for rid, ids in PROMPTS.items():
        alone = recording_engine(program, max_batch_size=4, max_context=400)
        run(alone, [make_prompt(rid, ids, max_tokens[rid], **sp)])
        assert generated(alone, rid) == want[rid], f"{rid} alone"
    batched = recording_engine(program, max_batch_size=4, max_context=400)
    run(batched, [make_prompt(rid, ids, max_tokens[rid], **sp) for rid, ids in PROMPTS.items()], stagger=True)
    for rid in PROMPTS:
        assert generated(batched, rid) == want[rid], f"{rid} in a batch"
    assert batched.allocator.num_used == 0, "every KV page is returned"


def test_sampled_tokens_do_not_depend_on_the_batch(program):
    sp = dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.3, seed=1234)
    alone = recording_engine(program, max_batch_size=4, max_context=400)
    run(alone, [make_prompt("x", PROMPTS["b"], 60, **sp)])
    crowd = recording_engine(program, max_batch_size=4, max_context=400)
    others = [make_prompt(r, PROMPTS[r], 50, temperature=1.0, seed=i) for i, r in enumerate("acd")]
    run(crowd, [others[0], make_prompt("x", PROMPTS["b"], 60, **sp), *others[1:]], stagger=True)
    assert alone.outputs["x"] == crowd.outputs["x"]
    assert len(alone.outputs["x"][0]) > 5


def test_constrained_requests_only_emit_audio_and_fill_their_budget(program):
    eng = recording_engine(program, max_batch_size=2, max_context=400)
    run(
        eng,
        [make_prompt("k", PROMPTS["a"], 100, temperature=0.6, top_p=0.8, constrained=True, min_tokens=91)],
    )
    gen, reason = eng.outputs["k"]
    assert reason == FinishReason.LENGTH and len(gen) == 100 - len(PROMPTS["a"])
    codes = np.array(gen) - 128266 - 4096 * (np.arange(len(gen)) % 7)
    assert ((codes > 0) & (codes < 4096)).all()


def test_requests_wait_for_kv_pages_instead_of_failing(program):
    # Room for one 100-token budget at a time (7 pages of 16 plus the reserved page 0).
    eng = recording_engine(program, max_batch_size=4, max_context=100, num_pages=8)
    prompts = [make_prompt(r, PROMPTS[r], 100, temperature=0.0) for r in "abc"]
    for p in prompts:
        eng.add(p)
    eng.step()
    assert len(eng.running) == 1 and len(eng.waiting) == 2
    run(eng, [])
    assert set(eng.outputs) == {"a", "b", "c"} and eng.allocator.num_used == 0
