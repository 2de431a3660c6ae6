"""`--constrained` is a server setting. A model without a constrained sampling mode (CSM) refuses it
at startup with a usage error; a constrained prompt that reaches its gpu_worker anyway ends with a
400 for that request alone, never failing the whole step (every request in it) with a 500."""

from __future__ import annotations

import pytest

from common.cli import main as cli_main
from common.config import GatewaySettings, GpuWorkerSettings, ServeConfig, check_model_settings
from common.messages import FinishReason, Prompt, SamplingParams
from gateway.pipeline import Pipeline
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from tests.specs import model_spec


def test_serve_refuses_constrained_for_csm(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--model", "csm-tiny", "--constrained"])
    assert e.value.code == 2
    assert "--constrained: csm-tiny has no constrained sampling mode" in capsys.readouterr().err


def test_a_gateway_run_alone_refuses_it_too():
    cfg = ServeConfig(model="csm-tiny", gateway=GatewaySettings(constrained=True))
    pipeline = Pipeline(cfg, addresses=None)
    with pytest.raises(ValueError, match="no constrained sampling mode"):
        pipeline.learn(model_spec("csm-tiny"))  # the spec the tokenizer workers announce


def test_models_with_the_mode_say_so_and_accept_it():
    for name in ("orpheus", "orpheus-tiny"):
        check_model_settings(
            ServeConfig(model=name, gateway=GatewaySettings(constrained=True)), get_spec(name)
        )
    check_model_settings(
        ServeConfig(model="csm", gateway=GatewaySettings(constrained=False)), get_spec("csm")
    )
    assert load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy").can_constrain
    assert not load_program_class("csm-tiny")(get_spec("csm-tiny"), load_format="dummy").can_constrain


def test_a_constrained_csm_prompt_gets_a_400_and_its_batch_runs_on():
    program = load_program_class("csm-tiny")(get_spec("csm-tiny"), load_format="dummy")
    program.load_lm()
    rows = program.preprocess("Hello there.", {"voice": "0"}).astype("<i4")

    def prompt(rid: str, constrained: bool) -> Prompt:
        sp = SamplingParams(max_tokens=len(rows) + 4, temperature=0.9, seed=1, constrained=constrained)
        return Prompt(rid, rows.tobytes(), len(rows), sp)

    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=256))
    eng.add(prompt("ok", False))
    eng.add(prompt("bad", True))
    done = {f.rid: f for batch in eng.run_until_idle() for f in batch.finished}
    assert done["bad"].status == 400 and "no constrained sampling mode" in done["bad"].message
    assert done["ok"].reason in (FinishReason.LENGTH, FinishReason.STOP) and done["ok"].status != 500
    assert eng.allocator.num_used == 0
