"""The WebSocket session's incremental segmentation (`gateway.incremental.Segmenter`): a segment
is handed out at a sentence end, after enough words, or on flush; however the text is cut into
appends, every character comes out once, in order, within the budget."""

from __future__ import annotations

import random

from gateway.incremental import Segmenter

BUDGET = 42


def test_a_sentence_speaks_once_the_character_after_its_full_stop_arrives() -> None:
    s = Segmenter(BUDGET)
    assert s.append("It costs 3.") == []  # "3." may go on as "3.5"
    assert s.append("5 euros. Then") == ["It costs 3.5 euros."]
    assert s.append(" more?") == []
    assert s.append("\n") == ["Then more?"]
    assert s.append("日本語の文。次") == ["日本語の文。"]  # a CJK full stop needs no space
    assert s.flush() == ["次"] and s.flush() == []


def test_enough_words_without_a_sentence_end_speak_at_a_clause_or_a_word() -> None:
    s = Segmenter(200, max_words=6)
    assert s.append("one two three four, five si") == []  # 5 complete words, the sixth still coming
    assert s.append("x") == []
    assert s.append(" sev") == ["one two three four,"]  # 6 complete: cut at the clause mark (4 >= 6 / 2)
    assert s.buffer == "five six sev"
    s = Segmenter(200, max_words=6)
    assert s.append("a b c d e f g") == ["a b c d e f"]  # no clause mark: after the last whole word
    assert s.buffer == "g"


def test_every_character_comes_out_once_in_order_within_the_budget() -> None:
    rng = random.Random(5)
    words = "the a voice speaks, every word; of this text. in order! and never? drops 日本語。 one".split()
    for _ in range(200):
        text = " ".join(rng.choices(words, k=rng.randint(1, 60)))
        s = Segmenter(BUDGET)
        out, at = [], 0
        while at < len(text):
            step = rng.randint(1, 12)
            out += s.append(text[at : at + step])
            at += step
            if rng.random() < 0.1:
                out += s.flush()
        out += s.flush()
        assert "".join("".join(seg.split()) for seg in out) == "".join(text.split())
        assert all(seg and seg == seg.strip() and len(seg.encode()) <= BUDGET for seg in out)
