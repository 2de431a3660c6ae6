"""Text tokenizer of Llama-3-based models: the checkpoint's `tokenizer.json`, or an offline stand-in.

The real one is the checkpoint's `tokenizer.json` (Llama-3 byte-level BPE whose post-processor
puts <|begin_of_text|> = 128000 first), read with the `tokenizers` library from a local dir, the
Hugging Face cache, or the hub.

The stand-in serves models without a checkpoint (the tiny ones) and `--load-format dummy` when the hub is unreachable: a
byte-level BPE built in code (a few ms) from a small built-in English text, so prompts keep a
realistic-ish length. Its text ids are < 128000 and it also puts BOS 128000 first, so prompts have
the real layout. Random-weight models do not care which text ids they see; a real checkpoint
does, so with real weights a missing tokenizer is an error, never a silent substitution.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from typing import Any
from urllib.parse import urlparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

log = logging.getLogger(__name__)

BOS_TOKEN = "<|begin_of_text|>"
_PROBE_TIMEOUT_S = 2.0

# Training text of the offline BPE: ordinary English, so common words become single tokens.
_CORPUS = """\
The sun was low over the harbor when the boats came back, and the people on the pier waited for
news of the storm. She said that it would be a long night, but nobody wanted to go home yet.
I think we should call them first, and then we can decide what to do about the weekend.
Could you tell me where the station is? It's just around the corner, next to the old library.
Thank you so much for coming today. We have a lot to talk about, and I want to hear your story.
He laughed and shook his head. "That is the strangest thing I have ever heard," he said.
Every morning I make coffee, read the paper, and listen to the radio before work.
The weather will be warm and sunny this afternoon, with a chance of rain in the evening.
Please remember to bring your ticket, your passport, and something to read on the train.
Well, honestly, I don't know. Maybe we could try again tomorrow, if that works for you?
"""


class TextTokenizer:
    """`encode(text)` → ids with BOS first, whichever tokenizer backs it; `text_ids(text)` without.

    Both tokenize their input as text only: the normalizer, pre-tokenizer and BPE model, never the
    tokenizer's added vocabulary. `tokenizers`' own `encode` matches added tokens (<|eot_id|>,
    <|begin_of_text|>, a checkpoint's <custom_token_N>, ...) in the input first, so text a client
    sent could put control tokens into a prompt; here "<|eot_id|>" in a text is the characters it
    spells. For text that holds no added token, the ids are `encode`'s.
    """

    def __init__(self, tokenizer: Tokenizer, bos_id: int, source: str, is_real: bool) -> None:
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.source = source
        self.is_real = is_real

    def encode(self, text: str) -> list[int]:
        """BOS, then `text_ids(text)` (BOS is what Llama-3's post-processor puts first)."""
        return [self.bos_id, *self.text_ids(text)]

    def text_ids(self, text: str) -> list[int]:
        """The ids of `text` as text (see the class docstring); no BOS."""
        tok = self.tokenizer
        if tok.normalizer is not None:
            text = tok.normalizer.normalize_str(text)
        pieces = tok.pre_tokenizer.pre_tokenize_str(text) if tok.pre_tokenizer is not None else [(text, None)]
        return [t.id for piece, _ in pieces for t in tok.model.tokenize(piece)]


def build_offline_tokenizer(bos_id: int = 128000, vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE trained on `_CORPUS`; deterministic, no file or network access."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # a small text: let every pair merge, like a real vocab would
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.train_from_iterator(_CORPUS.splitlines(), trainer)
    # Rebuild with BOS inside the vocab at Llama-3's id (the trainer would give it the next free id).
    trained = json.loads(base.to_str())["model"]
    vocab = {**trained["vocab"], BOS_TOKEN: bos_id}
    merges = [tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tok


def _hub_reachable(timeout: float = _PROBE_TIMEOUT_S) -> bool:
    """A TCP connect to the hub endpoint, bounded in time. huggingface_hub retries a dead
    connection for ~25 s, which would stall the tokenizer worker's start-up for nothing."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # a proxy decides; a direct probe would say nothing
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)  # DNS lookups ignore socket timeouts
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _offline_env() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


def _find_tokenizer_json(weights: str) -> str:
    """Path of the checkpoint's tokenizer.json: local dir, then the HF cache, then the hub."""
    if os.path.isdir(weights):
        path = os.path.join(weights, "tokenizer.json")
        if os.path.isfile(path):
            return path
        raise FileNotFoundError(f"{weights} has no tokenizer.json")
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(weights, "tokenizer.json")
    if isinstance(cached, str):
        return cached
    if _offline_env():
        raise FileNotFoundError(
            f"tokenizer.json of {weights} is not in the Hugging Face cache (HF_HUB_OFFLINE)"
        )
    if not _hub_reachable():
        raise ConnectionError(
            f"the Hugging Face hub is unreachable, and tokenizer.json of {weights} is not cached"
        )
    return hf_hub_download(weights, "tokenizer.json")


def _offline(bos_id: int) -> TextTokenizer:
    return TextTokenizer(build_offline_tokenizer(bos_id), bos_id, "offline byte-level BPE", is_real=False)


def load_text_tokenizer(spec: dict[str, Any], weights: str | None, load_format: str) -> TextTokenizer:
    """The real tokenizer for `weights` (dir or hub id), or the offline stand-in where allowed:
    models without a checkpoint (the tiny ones), or dummy weights when the real one is unreachable."""
    bos_id = spec.get("bos_id", 128000)
    if weights is None:
        return _offline(bos_id)  # no checkpoint behind this model: nothing real to match
    from huggingface_hub.errors import EntryNotFoundError

    try:
        path = _find_tokenizer_json(weights)
    except (FileNotFoundError, EntryNotFoundError) as missing:
        # No tokenizer.json in a local directory, or on a hub that answered: its vocab files? (A hub
        # id not in the cache while offline is no such case: asking again would only wait.)
        if isinstance(missing, FileNotFoundError) and not os.path.isdir(weights):
            return _unavailable(weights, load_format, missing, bos_id)
        try:
            return TextTokenizer(_from_vocab_files(weights), bos_id, weights, is_real=True)
        except Exception:
            return _unavailable(weights, load_format, missing, bos_id)
    except Exception as e:
        return _unavailable(weights, load_format, e, bos_id)
    return TextTokenizer(Tokenizer.from_file(path), bos_id, path, is_real=True)


def _from_vocab_files(path: str) -> Tokenizer:
    """The fast tokenizer of a checkpoint that ships its BPE as vocab.json and merges.txt with a
    tokenizer_config.json naming its class (Qwen2Tokenizer, say), as transformers converts it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, use_fast=True).backend_tokenizer


def _unavailable(weights: str, load_format: str, e: Exception, bos_id: int) -> TextTokenizer:
    """No tokenizer for `weights`: an error with real weights, the offline stand-in with dummy ones."""
    if load_format != "dummy":
        raise OSError(
            f"cannot load the tokenizer of {weights}: {e}. Pass --weights a local directory holding "
            "the checkpoint's tokenizer.json (or vocab.json, merges.txt and tokenizer_config.json), "
            "or use --load-format dummy for random weights."
        ) from e
    log.warning(
        "tokenizer of %s unavailable (%s); dummy weights, so an offline byte-level BPE stands in "
        "(text ids differ from the real tokenizer's)",
        weights,
        e,
    )
    return _offline(bos_id)
