"""A checkpoint that ships its BPE as vocab.json and merges.txt (Qwen2's layout, as Qwen3-TTS's do)
and no tokenizer.json still gets its real tokenizer: the ids transformers' Qwen2 tokenizer gives,
its added tokens never matched in user text; a directory with neither fails loudly with real
weights and falls back to the stand-in with dummy ones."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen2TokenizerFast

from programs.blocks.text_tokenizer import build_offline_tokenizer, load_text_tokenizer

TEXTS = ["Hello there, how are you today?", "It's 3:45 p.m.\nSee you   soon!", "naïve café — ok"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_like")
    build_offline_tokenizer(vocab_size=600).model.save(str(path))  # vocab.json, merges.txt
    special = {"content": "<|im_start|>", "special": True, "lstrip": False, "rstrip": False,
               "normalized": False, "single_word": False}  # fmt: skip
    vocab = json.loads((path / "vocab.json").read_text())
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(len(vocab)): special},
        "additional_special_tokens": ["<|im_start|>"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_the_vocab_files_give_transformers_ids_and_no_control_token_from_text(checkpoint):
    tok = load_text_tokenizer({"bos_id": 0}, str(checkpoint), "auto")
    assert tok.is_real
    hf = Qwen2TokenizerFast.from_pretrained(str(checkpoint))
    for text in TEXTS:
        ids = tok.text_ids(text)
        assert ids == hf.encode(text) and hf.decode(ids) == text, text
        assert len(ids) < len(text.encode()), "merges apply: fewer ids than bytes"
    im_start = hf.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in tok.text_ids("<|im_start|>user")


def test_a_directory_without_a_tokenizer_fails_with_real_weights(tmp_path):
    with pytest.raises(OSError, match="vocab.json"):
        load_text_tokenizer({"bos_id": 0}, str(tmp_path), "auto")
    assert not load_text_tokenizer({"bos_id": 0}, str(tmp_path), "dummy").is_real
