"""On a CPU the default LM head is the audio head (codec tokens and stop): the full head's 156,940
rows are most of a small model's step there, and with them the embedded default model falls behind
real time. On a GPU the default stays the full head; `--lm-head` chooses either anywhere."""

from __future__ import annotations

from common.config import GpuWorkerSettings
from common.options import parse_role


def test_auto_is_audio_on_a_cpu_and_full_on_a_gpu() -> None:
    auto = GpuWorkerSettings()
    assert auto.lm_head == "auto"
    assert (auto.head_for("cpu"), auto.head_for("cuda"), auto.head_for("cuda:1")) == ("audio", "full", "full")


def test_the_flag_wins_on_any_device() -> None:
    for head in ("full", "audio"):
        cfg = parse_role("gpu_worker", ["--lm-head", head, "--gpu-in", "ipc:///tmp/g"]).cfg
        assert cfg.gpu.head_for("cpu") == cfg.gpu.head_for("cuda") == head
    env = {"VOXPIPE_LM_HEAD": "full"}
    assert parse_role("gpu_worker", ["--gpu-in", "ipc:///tmp/g"], env).cfg.gpu.head_for("cpu") == "full"
