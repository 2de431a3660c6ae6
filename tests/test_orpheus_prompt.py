"""Orpheus prompts: `[128259] + BOS 128000 + text ids + [128009, 128260, 128261, 128257]`, voices,
bad requests as ValueError, and which tokenizer backs them (offline stand-in or tokenizer.json)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from programs import get_spec
from programs.blocks.text_tokenizer import build_offline_tokenizer, load_text_tokenizer
from programs.orpheus.program import OrpheusProgram

PREFIX, BOS, SUFFIX = [128259], 128000, [128009, 128260, 128261, 128257]


@pytest.fixture(scope="module")
def tiny() -> OrpheusProgram:
    return OrpheusProgram(get_spec("orpheus-tiny"))


def test_prompt_layout_wraps_voice_and_text(tiny) -> None:
    rows = tiny.preprocess("Hello there, how are you?", {})
    assert rows.dtype == np.int32 and rows.ndim == 2 and rows.shape[1] == 1
    ids = rows[:, 0].tolist()
    assert ids[:2] == [*PREFIX, BOS] and ids[-4:] == SUFFIX
    text_ids = ids[2:-4]
    assert text_ids and max(text_ids) < 128000
    assert tiny._tokenizer.tokenizer.decode(text_ids) == "tara: Hello there, how are you?"


def test_voice_selects_the_text_prefix(tiny) -> None:
    default = tiny.preprocess("Good morning.", {})
    tara = tiny.preprocess("Good morning.", {"voice": "tara"})
    leo = tiny.preprocess("Good morning.", {"voice": "leo"})
    assert np.array_equal(default, tara)
    assert tiny._tokenizer.tokenizer.decode(leo[2:-4, 0].tolist()) == "leo: Good morning."


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("Hi.", {"voice": "bob"}, "tara, leah, jess, leo, dan, mia, zac, zoe"),
        ("", {}, "empty"),
        ("   ", {}, "empty"),
        ("Hi.", {"speed": "2"}, "voice"),
    ],
)
def test_bad_requests_raise_value_error(tiny, text, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.preprocess(text, kwargs)


def test_offline_tokenizer_is_deterministic_and_keeps_bos() -> None:
    a, b = build_offline_tokenizer(), build_offline_tokenizer()
    text = "zoe: Thank you so much for coming, naïve café 🎉!"
    assert a.encode(text).ids == b.encode(text).ids
    assert a.encode(text).ids[0] == BOS and max(a.encode(text).ids[1:]) < 128000
    assert a.decode(a.encode(text).ids[1:]) == text


def test_dummy_3b_without_hub_falls_back_quickly(monkeypatch, caplog) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as if the hub were unreachable, without waiting on it
    start = time.perf_counter()
    program = OrpheusProgram(get_spec("orpheus"), load_format="dummy")
    ids = program.preprocess("Hello.", {"voice": "mia"})[:, 0].tolist()
    assert time.perf_counter() - start < 5
    assert ids[:2] == [*PREFIX, BOS] and ids[-4:] == SUFFIX
    assert not program._tokenizer.is_real
    assert any("stands in" in r.getMessage() for r in caplog.records)


def test_real_weights_without_tokenizer_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="--weights"):
        load_text_tokenizer(get_spec("orpheus"), "canopylabs/orpheus-3b-0.1-ft", "auto")


def test_tokenizer_json_from_a_weights_dir_is_used(tmp_path) -> None:
    # A tokenizer.json without a BOS post-processor: BOS 128000 is still put first.
    tok = build_offline_tokenizer()
    tok.post_processor = None
    tok.save(str(tmp_path / "tokenizer.json"))
    program = OrpheusProgram(get_spec("orpheus"), weights=str(tmp_path))
    ids = program.preprocess("Hello.", {})[:, 0].tolist()
    assert program._tokenizer.is_real
    assert ids == [*PREFIX, BOS, *tok.encode("tara: Hello.").ids, *SUFFIX]
