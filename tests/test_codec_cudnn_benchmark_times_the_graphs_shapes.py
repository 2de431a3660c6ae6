"""`--codec-cudnn-benchmark` (auto by default) reaches the codec_worker's settings from the flag and
the environment, anything but auto/on/off is refused with the flag's name, and the codec times its
convolution algorithms while it captures its graphs (auto, on) and serves afterwards as the process
set it: auto leaves shapes met while serving to cuDNN's heuristic."""

from __future__ import annotations

import pytest
import torch

from codec_worker.codec import Codec
from codec_worker.worker import cudnn_benchmark
from common.config import CodecSettings
from common.options import parse_role
from programs import get_spec, load_program_class


def test_each_choice_sets_the_process_and_the_graphs_capture():
    assert cudnn_benchmark("auto") == (False, True)  # the graphs' shapes alone
    assert cudnn_benchmark("on") == (True, True)
    assert cudnn_benchmark("off") == (False, False)


def test_the_option_is_auto_by_default_parsed_and_checked():
    assert CodecSettings().cudnn_benchmark == "auto"
    for value in ("on", "off", "auto"):
        assert (
            parse_role("codec_worker", ["--codec-cudnn-benchmark", value], {}).cfg.codec.cudnn_benchmark
            == value
        )
    env = parse_role("codec_worker", [], {"VOXPIPE_CODEC_CUDNN_BENCHMARK": "on"})
    assert env.cfg.codec.cudnn_benchmark == "on"
    with pytest.raises(ValueError, match="--codec-cudnn-benchmark"):
        CodecSettings(cudnn_benchmark="yes").check()


class _Recording(Codec):
    """A Codec whose capture records cuDNN's benchmark flag instead of capturing graphs."""

    def _capture(self, progress) -> None:
        self.benchmark_in_capture = torch.backends.cudnn.benchmark


@pytest.mark.parametrize("serving", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_the_graphs_capture_times_their_shapes_and_serving_keeps_the_process_setting(serving, graphs):
    program = load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy", device="cpu")
    program.load_codec()
    program.device = torch.device("cuda")  # only the capture's branch reads it here
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = serving
    try:
        codec = _Recording(program, max_batch=4, benchmark_graphs=graphs)
        assert codec.benchmark_in_capture is (graphs or serving)
        assert torch.backends.cudnn.benchmark is serving
    finally:
        torch.backends.cudnn.benchmark = before
