"""A model's spec may choose settings for itself (`serve_defaults`: what it is measured to serve
best with): every role that loads the model takes them where neither a flag nor a variable sets
the option; `--config-json` (the whole deployment's config) and the gateway (which loads no model)
do not; each names a real option with a value it accepts."""

from __future__ import annotations

import argparse

import pytest

from common import options
from common.config import ServeConfig
from common.options import OPTIONS, model_defaults, parse_role, resolve
from programs import get_spec, model_names


@pytest.mark.parametrize("model", ["qwen3-tts", "qwen3-tts-0.6b", "qwen3-tts-voicedesign"])
def test_qwen3_tts_serves_with_the_fused_step_late_launch_and_merged_windows(model):
    for role in ("serve", "gpu_worker"):
        gpu = parse_role(role, ["--model", model], {}).cfg.gpu
        assert (gpu.fused_step, gpu.late_launch) == ("on", "on")
    for role in ("serve", "codec_worker"):
        assert parse_role(role, ["--model", model], {}).cfg.codec.merge == 8
    cfg = parse_role("serve", ["--model", "qwen3-tts-base"], {}).cfg  # cloning: unmeasured with them
    assert (cfg.gpu.fused_step, cfg.gpu.late_launch, cfg.codec.merge) == ("off", "off", 1)
    cfg = parse_role("serve", ["--model", "qwen3-tts-tiny"], {}).cfg  # tests' model: the runtime's
    assert (cfg.gpu.fused_step, cfg.gpu.late_launch, cfg.codec.merge) == ("off", "off", 1)
    cfg = parse_role("serve", [], {}).cfg  # the default model
    assert (cfg.gpu.fused_step, cfg.gpu.late_launch, cfg.codec.merge) == ("off", "off", 1)


def test_a_flag_or_a_variable_overrides_the_models_choice():
    settings = parse_role("serve", ["--model", "qwen3-tts", "--fused-step", "off"], {})
    assert (settings.cfg.gpu.fused_step, settings.cfg.gpu.late_launch) == ("off", "on")
    assert settings.chosen == {
        "late_launch": "on",
        "prompt_lane": "on",
        "prompt_lanes": 2,
        "codec_merge": 8,
    }  # what serve logs it chose
    cfg = parse_role("serve", [], {"VOXPIPE_MODEL": "qwen3-tts", "VOXPIPE_CODEC_MERGE": "2"}).cfg
    assert (cfg.codec.merge, cfg.gpu.late_launch) == (2, "on")


def test_a_config_json_is_taken_whole():
    ns = argparse.Namespace(config_json=ServeConfig(model="qwen3-tts").to_json())
    cfg = resolve("gpu_worker", ns, {}).cfg
    assert (cfg.gpu.fused_step, cfg.gpu.late_launch) == ("off", "off")


def test_the_gateway_loads_no_model_for_them(monkeypatch):
    def loads(model):
        raise AssertionError("the gateway imports no program")

    monkeypatch.setattr(options, "model_defaults", loads)
    assert resolve("gateway", argparse.Namespace(model="qwen3-tts"), {}).cfg.model == "qwen3-tts"


def test_every_models_defaults_name_an_option_and_a_value_it_takes():
    by_field = {o.field: o for o in OPTIONS if o.kind == "config"}
    seen = 0
    for name in model_names():
        for field, value in get_spec(name).get("serve_defaults", {}).items():
            seen += 1
            opt = by_field.get(field)
            assert opt is not None and "serve" in opt.roles, f"{name}: {field} is no serve option"
            # a separately run gateway takes no model defaults: none of its settings may be one
            assert "gateway" not in opt.roles, f"{name}: {field} is the gateway's too"
            assert not opt.choices or value in opt.choices, f"{name}: {field}={value!r}"
            cfg = ServeConfig(model=name)
            opt.apply(cfg, value)
            cfg.check()  # the value passes the option's own check
        assert model_defaults(name) == get_spec(name).get("serve_defaults", {})
    assert seen  # some model chooses settings for itself
    assert model_defaults("no-such-model") == {}


def test_a_bench_result_names_the_settings_the_model_chose_and_the_command_did_not():
    from bench.provenance import model_settings

    assert model_settings("qwen3-tts", ["--max-batch-size", "256", "--fused-step", "off"]) == {
        "late_launch": "on",
        "prompt_lane": "on",
        "prompt_lanes": 2,
        "codec_merge": 8,
    }
    assert model_settings("qwen3-tts", ["--codec-merge=2"]) == {
        "fused_step": "on",
        "late_launch": "on",
        "prompt_lane": "on",
        "prompt_lanes": 2,
    }
    assert model_settings("orpheus", []) == {}


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
