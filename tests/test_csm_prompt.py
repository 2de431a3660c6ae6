"""CSM prompts follow transformers' chat template: `<bos>[speaker]text<eos>` per turn, a context turn's
Mimi frames and the all-zero end frame after its text, the turn to speak last; options are
checked with messages that name the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from programs import get_spec, load_program_class
from programs.csm.spec import BOS_ID, EOS_ID, TEXT_MARK


@pytest.fixture(scope="module")
def program():
    return load_program_class("csm-tiny")(get_spec("csm-tiny"), load_format="dummy")


def test_the_turn_to_speak_is_bos_speaker_text_eos_as_text_rows(program):
    rows = program.preprocess("Hello there.", {"voice": "3"})
    body = program._tokenizer.tokenizer.encode("[3]Hello there.", add_special_tokens=False).ids
    assert rows.shape == (len(body) + 2, 32) and rows.dtype == np.int32
    assert rows[:, 0].tolist() == [BOS_ID, *body, EOS_ID]
    assert (rows[:, 1:] == TEXT_MARK).all()


def test_a_context_turn_brings_its_frames_and_the_end_frame_before_the_turn(program):
    frames = [[(f + k) % 2048 for k in range(32)] for f in range(3)]
    ctx = json.dumps([{"speaker": 0, "text": "Hi.", "codes": frames}])
    rows = program.preprocess("Bye.", {"voice": "1", "context": ctx})
    first = program.preprocess("Hi.", {"voice": "0"})
    last = program.preprocess("Bye.", {"voice": "1"})
    n = len(first)
    np.testing.assert_array_equal(rows[:n], first)
    np.testing.assert_array_equal(rows[n : n + 3], frames)
    assert (rows[n + 3] == 0).all()
    np.testing.assert_array_equal(rows[n + 4 :], last)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"voice": "alice"}, "speaker id"),
        ({"context": "not json"}, "not JSON"),
        ({"context": json.dumps([{"speaker": 0, "text": "x"}])}, "no 'codes'"),
        ({"context": json.dumps([{"speaker": 0, "text": "x", "codes": [[1] * 31]}])}, "frames of 32"),
        ({"context": json.dumps([{"speaker": 0, "text": "x", "codes": [[2048] * 32]}])}, "[0, 2048)"),
        ({"language": "en"}, "'voice' and 'context'"),
    ],
)
def test_bad_options_are_value_errors_that_say_what_to_send(program, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        program.preprocess("Hello.", kwargs)
