"""`--codec-cudnn-benchmark` (off by default) reaches the codec_worker's settings from the flag and
the environment, and anything but on/off is refused with the flag's name."""

from __future__ import annotations

import pytest

from common.config import CodecSettings
from common.options import parse_role


def test_the_option_is_off_by_default_parsed_and_checked():
    assert CodecSettings().cudnn_benchmark == "off"
    on = parse_role("codec_worker", ["--codec-cudnn-benchmark", "on"], {})
    assert on.cfg.codec.cudnn_benchmark == "on"
    env = parse_role("codec_worker", [], {"VOXPIPE_CODEC_CUDNN_BENCHMARK": "on"})
    assert env.cfg.codec.cudnn_benchmark == "on"
    with pytest.raises(ValueError, match="--codec-cudnn-benchmark"):
        CodecSettings(cudnn_benchmark="yes").check()
