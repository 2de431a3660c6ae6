"""`--kv-cache-dtype fp8`: keys and values are stored as float8 e4m3 (scale 1) and attended in the
model's precision. On CPU fp32 the engine then generates exactly what transformers' Llama does when
its keys and values are rounded through float8, alone and inside a batch."""

from __future__ import annotations

import pytest
import torch
from test_lm_parity import PROMPTS, generated, hf_generate, hf_model, make_prompt, program, run  # noqa: F401
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from common.options import parse_role
from gpu_worker.engine import Engine, EngineLimits
from gpu_worker.runner.kv_cache import kv_cache_dtype

FP8 = torch.float8_e4m3fn


def _fp8_rounded_sdpa(module, query, key, value, attention_mask, **kwargs):
    key, value = key.to(FP8).to(query.dtype), value.to(FP8).to(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("fp8_rounded_kv", _fp8_rounded_sdpa)


@pytest.fixture
def hf_fp8(hf_model):  # noqa: F811
    before = hf_model.config._attn_implementation
    hf_model.set_attn_implementation("fp8_rounded_kv")
    yield hf_model
    hf_model.set_attn_implementation(before)


def fp8_engine(program) -> Engine:  # noqa: F811
    eng = Engine(program, EngineLimits(max_batch_size=4, max_context=400, kv_cache_dtype="fp8"))
    eng.outputs = {}
    return eng


def test_the_cache_holds_float8_and_the_names_are_checked():
    assert kv_cache_dtype("fp8", torch.bfloat16) == FP8
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="kv cache dtype"):
        kv_cache_dtype("int4", torch.float32)


def test_greedy_tokens_equal_transformers_with_fp8_rounded_keys_and_values(program, hf_fp8):  # noqa: F811
    max_tokens = {"a": 40, "b": 60, "c": 25, "d": 70}
    want = {rid: hf_generate(hf_fp8, ids, max_tokens[rid], 1.0) for rid, ids in PROMPTS.items()}
    for rid, ids in PROMPTS.items():
        alone = fp8_engine(program)
        assert alone.kv_cache.dtype == FP8
        run(alone, [make_prompt(rid, ids, max_tokens[rid], temperature=0.0)])
        assert generated(alone, rid) == want[rid], f"{rid} alone"
    batched = fp8_engine(program)
    run(
        batched,
        [make_prompt(r, ids, max_tokens[r], temperature=0.0) for r, ids in PROMPTS.items()],
        stagger=True,
    )
    for rid in PROMPTS:
        assert generated(batched, rid) == want[rid], f"{rid} in a batch"
    assert batched.allocator.num_used == 0


def test_rounding_keys_and_values_changes_what_is_generated(program, hf_model, hf_fp8):  # noqa: F811
    """The reference above is not the unrounded model in disguise: fp8 moves the logits."""
    ids = PROMPTS["d"]
    with torch.no_grad():
        x = torch.tensor([ids])
        hf_fp8.set_attn_implementation("fp8_rounded_kv")
        rounded = hf_fp8(x).logits
        hf_model.set_attn_implementation("sdpa")
        exact = hf_model(x).logits
    assert (rounded - exact).abs().max() > 1e-4


def test_the_flag_reaches_the_gpu_worker_settings():
    assert parse_role("gpu_worker", ["--kv-cache-dtype", "fp8"], {}).cfg.gpu.kv_cache_dtype == "fp8"
    assert parse_role("gpu_worker", [], {"VOXPIPE_KV_CACHE_DTYPE": "fp8"}).cfg.gpu.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parse_role("gpu_worker", ["--kv-cache-dtype", "int8"], {})
