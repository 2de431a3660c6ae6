"""`--codec-lead-batch N`: the largest batch of lead windows (first chunks) and of tail windows
shorter than a regular window that the codec decodes at once, and so the largest graph of those
kinds on a GPU: 16 by default, at most `--codec-max-batch`. A burst's first chunks queue in parts of
this many, one after another."""

from __future__ import annotations

import pytest

from codec_worker.codec import LEAD_MAX_BATCH, Codec
from common.config import CodecSettings
from common.options import parse_role
from programs import get_spec, load_program_class


@pytest.fixture(scope="module")
def program():
    return load_program_class("orpheus-tiny")(get_spec("orpheus-tiny"), load_format="dummy")


def test_lead_windows_and_short_tails_take_the_lead_batch(program):
    leads = {(r, 0) for r in program.detok_lead}  # 7, 14 and 21 rows: first chunks of 1-3 frames
    short_tails = {(14, 7), (21, 7)}  # a stream's newest frame after 1 or 2 frames of context
    full = (program.detok_interval, 0)
    default = Codec.window_limits(program, 128, tails=True, compile_tails=True)
    assert {k: default[k] for k in leads | short_tails} == dict.fromkeys(leads | short_tails, LEAD_MAX_BATCH)
    assert default[full] == 128 and default[28, 7] == 128  # compiled tails: as regular windows
    wide = Codec.window_limits(program, 128, lead_batch=128, tails=True)
    assert {k: wide[k] for k in leads | short_tails | {(28, 7)}} == dict.fromkeys(
        leads | short_tails | {(28, 7)}, 128
    )
    assert Codec.window_limits(program, 64, lead_batch=128)[21, 0] == 64  # at most the max batch
    assert set(Codec.window_limits(program, 128)) == leads | {full}  # no tails without progressive chunks


def test_the_flag_reaches_the_codec_settings_and_a_negative_one_is_refused():
    s = parse_role("codec_worker", ["--model", "orpheus-tiny", "--codec-lead-batch", "128"], {})
    assert s.cfg.codec.lead_batch == 128
    assert parse_role("serve", ["--model", "orpheus-tiny"], {}).cfg.codec.lead_batch == 0
    with pytest.raises(ValueError, match="--codec-lead-batch"):
        CodecSettings(lead_batch=-1).check()
