"""bench/op_invariance.py's detector: the first batch size at which a row's result changes."""

import torch

from bench import op_invariance
from bench.op_invariance import first_variant_size, gemm_checks, mixed_checks, sampling_checks

SIZES = [1, 2, 4, 8, 16]


def test_a_row_wise_op_is_invariant_at_every_size():
    rows = torch.randn(16, 5)
    assert first_variant_size(lambda a: a * 2 + 1, rows, SIZES) is None


def test_an_op_that_reads_the_batch_is_caught_at_the_first_size_where_it_does():
    rows = torch.randn(16, 5)
    assert first_variant_size(lambda a: a + a.shape[0] * 1e-3, rows, SIZES) == 2
    # like a library choosing another kernel past a size: only from 8 rows on
    assert first_variant_size(lambda a: a + (a.shape[0] >= 8) * 1e-3, rows, SIZES) == 8
    # a change in the last bit counts: bit-identical or not
    assert first_variant_size(lambda a: a if a.shape[0] < 4 else torch.nextafter(a, a + 1), rows, SIZES) == 4


def test_sizes_past_the_rows_given_are_not_run():
    calls = []

    def op(a):
        calls.append(a.shape[0])
        return a

    assert first_variant_size(op, torch.randn(4, 3), SIZES) is None
    assert max(calls) == 4


def test_the_gemm_checks_report_each_shape_on_cpu():
    res = gemm_checks("cpu", [1, 2, 4], shapes=(("small", 32, 16), ("wide", 64, 32)))
    assert set(res) == {"small", "wide"}
    for v in res.values():
        assert set(v) == {"bf16", "bf16_tiled"} and (v["bf16"] is None or v["bf16"] in (2, 4))
        assert v["bf16_tiled"] is None  # one GEMM shape at every row count


def test_a_models_shapes_come_from_its_shipped_config():
    shapes = dict((name, (n, k)) for name, n, k in op_invariance.model_gemms("chatterbox"))
    # T3: hidden 1024, 16 heads of 64 (no GQA), feed-forward 4096
    assert shapes == {"qkv": (3072, 1024), "o": (1024, 1024), "gate_up": (8192, 1024), "down": (1024, 4096)}
    assert dict((n, (a, b)) for n, a, b in op_invariance.model_gemms("qwen3-tts"))["down"] == (2048, 6144)


def test_the_sampling_checks_report_each_reduction_and_the_samplers_scan_is_invariant_on_cpu():
    res = sampling_checks("cpu", [1, 2, 4, 8], vocabs=(("narrow", 33), ("wide", 4097)))
    assert set(res) == {"narrow", "wide"}
    for v in res.values():
        assert set(v) == {"softmax", "cumsum", "fixed_mass_cumsum"}
        assert v["fixed_mass_cumsum"] is None


def test_the_mixed_gemm_check_finds_the_first_pair_of_part_sizes_that_rounds_apart(monkeypatch):
    shapes = (("small", 32, 16),)
    res = mixed_checks("cpu", [1, 2, 4], prompt_rows=(2, 4), shapes=shapes)
    assert set(res["small"]) == {"bf16"}  # float8 on a GPU only
    # a GEMM that picks another kernel from 7 rows on: 4 prompt rows and 4 decode rows are the first
    monkeypatch.setattr(op_invariance.fp8, "linear", lambda a, w: a[:, :1] * 2 + (a.shape[0] >= 7) * 0.5)
    assert mixed_checks("cpu", [1, 2, 4], prompt_rows=(2, 4), shapes=shapes)["small"]["bf16"] == [4, 4]
    monkeypatch.setattr(op_invariance.fp8, "linear", lambda a, w: a[:, :1] * 2)  # row-wise: never
    assert mixed_checks("cpu", [1, 2, 4], prompt_rows=(2, 4), shapes=shapes)["small"]["bf16"] is None
