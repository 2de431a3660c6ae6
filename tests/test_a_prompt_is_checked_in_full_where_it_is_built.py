"""A prompt is checked in full where it is built: rows that break the program contract ([R, C] ids
in [0, input_vocab_size)) end that request with a 500 at the tokenizer worker, and what later hops
check of a Prompt off the wire is only that its bytes are R rows of C ids (`Prompt.shape_error`)."""

from __future__ import annotations

import numpy as np
import pytest

from common.messages import GenerateRequest, Prompt, RequestError, SamplingParams
from programs import get_spec, load_program_class
from tokenizer_worker.worker import PromptBuilder

CSM = load_program_class("csm-tiny")


class _Builds(CSM):
    """csm-tiny whose prompt builder returns fixed rows (a program with a bug in preprocess)."""

    rows = np.zeros((0, 32), dtype=np.int32)

    def preprocess(self, text: str, model_kwargs: dict[str, str]) -> np.ndarray:
        return self.rows


@pytest.mark.parametrize(
    "rows, why",
    [
        (np.zeros((3, 31), dtype=np.int32), "not [R, 32]"),
        (np.zeros((0, 32), dtype=np.int32), "R > 0"),
        (np.zeros(32, dtype=np.int32), "not [R, 32]"),
        (np.full((2, 32), -1, dtype=np.int32), "ids outside"),
        (np.full((2, 32), 10**6, dtype=np.int32), "ids outside"),
    ],
)
def test_rows_that_break_the_contract_fail_their_request_at_the_builder(rows: np.ndarray, why: str) -> None:
    program = _Builds(get_spec("csm-tiny"), load_format="dummy")
    program.rows = rows
    out = PromptBuilder(program, max_context=400).build(
        GenerateRequest("r", "hi", SamplingParams(max_tokens=400))
    )
    assert isinstance(out, RequestError) and out.status == 500 and why in out.message


def test_a_good_prompt_passes_and_its_bytes_add_up() -> None:
    program = CSM(get_spec("csm-tiny"), load_format="dummy")
    out = PromptBuilder(program, max_context=400).build(
        GenerateRequest("r", "Hello.", SamplingParams(max_tokens=400))
    )
    assert isinstance(out, Prompt) and out.shape_error(32) == ""
    assert Prompt("r", out.tokens[:-4], out.n_rows, out.sampling).shape_error(32)  # one id short
