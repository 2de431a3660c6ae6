"""`bench.load.step_bounds`: a load level's `server_during` gauges say what sets its pace: the
device busy through the step interval (and which part of the fitted step is largest: its fixed
part, its part per row, its part per token of context), the host's work filling the interval while
the device idles, the codec busy, or nothing (the steps wait for work)."""

from __future__ import annotations

import json
import os

import pytest

from bench.load import step_bounds

RESULTS = os.path.join(os.path.dirname(__file__), "..", "bench", "results")


def gauges(**kw) -> dict:
    base = dict(row_period_ms=10.0, step_gpu_ms=9.8, step_host_ms=3.0, step_gpu_idle_ms=0.01,
                codec_busy_seconds_per_s=0.6, decode_batch_size=400.0, life_context=500.0,
                step_cost_fixed_ms=3.0, step_cost_token_us=10.0, step_cost_kcontext_us=12.0)  # fmt: skip
    return base | kw


def test_the_parts_of_the_fitted_step_at_the_levels_load():
    out = step_bounds(gauges())
    assert out["fit_fixed_ms"] == 3.0 and out["fit_rows_ms"] == 4.0
    assert out["fit_context_ms"] == pytest.approx(2.4)  # 400 rows x 0.5 kilotokens x 12 us
    assert out["gpu_busy_share"] == 0.98 and out["host_share"] == 0.3
    assert out["bound"] == "gpu: rows"
    assert step_bounds(gauges(decode_batch_size=100.0))["bound"] == "gpu: fixed"


@pytest.mark.parametrize(
    "change, bound",
    [
        (dict(codec_busy_seconds_per_s=0.95), "codec"),
        (dict(step_host_ms=9.5, step_gpu_ms=6.0, step_gpu_idle_ms=3.5), "host"),
        (dict(step_gpu_ms=5.0, step_gpu_idle_ms=5.0), "none"),
        (dict(step_cost_fixed_ms=None), "gpu"),  # no fit yet: the device, parts unknown
        (dict(step_gpu_ms=0.0, step_gpu_idle_ms=0.0, step_host_ms=9.9), "host"),  # a CPU runs the steps
        (dict(step_gpu_ms=0.0, step_gpu_idle_ms=0.0, step_host_ms=5.0), "none"),
    ],
)
def test_the_verdict(change, bound):
    assert step_bounds(gauges(**change))["bound"] == bound


def test_no_gauges_no_verdict():
    assert step_bounds({}) == {} and step_bounds(gauges(step_gpu_ms=None)) == {}


def test_the_curve_of_record_is_bound_by_the_gpu_at_its_capacity():
    with open(os.path.join(RESULTS, "h200-orpheus-load-curve.json")) as f:
        curve = {p["concurrency"]: p for p in json.load(f)["curve"]}
    out = step_bounds(curve[416]["server_during"])
    assert out["bound"] == "gpu: rows" and out["codec_busy"] < 0.9 and out["host_share"] < 0.5
