"""Chatterbox constants, torch-free (the gateway and tokenizer workers read them): the T3 token ids,
the prompt's id ranges, sampling defaults, and SPECS, the served variants.

Facts from chatterbox-tts 0.1.7 (the reference: `tts.py`, `models/t3`), and the published
ResembleAI/chatterbox checkpoint (configs/, docs/models/chatterbox.md):

- T3's prompt is the conditioning (the speaker embedding's projection, 32 perceiver-resampled rows of
  the voice's prompt speech tokens, the emotion `exaggeration`'s projection: COND_ROWS rows), the
  text (start-of-text 255, the text's ids, stop-of-text 0, with learned text positions), then
  start-of-speech 6561 twice at speech position 0 (the reference's initial speech token and its bos);
- with classifier-free guidance every request also runs the unconditional prompt, whose text rows
  keep their positions but not their token embeddings; generated speech token i sits at speech
  position i + 1; 6562 stops; ids below 6561 are S3 speech tokens (25 per second).

Prompt row ids (one column; `ChatterboxProgram.embed` reads them): [0, SPEECH_VOCAB) speech tokens,
TEXT + t text token t, UNCOND_TEXT + t the unconditional prompt's text token t, COND + j
conditioning row j (the request's state).
"""

from __future__ import annotations

SPEECH_VOCAB = 8194  # T3's speech ids: 6561 S3 tokens, start, stop, and unused ids
TEXT_VOCAB = 704  # the English text tokenizer's ids
START_SPEECH = 6561
STOP_SPEECH = 6562
START_TEXT = 255
STOP_TEXT = 0
SPEECH_CODES = 6561  # S3 speech tokens: ids below this are audio
COND_ROWS = 34  # speaker (1) + perceiver queries (32) + emotion (1)
TEXT = SPEECH_VOCAB
UNCOND_TEXT = TEXT + TEXT_VOCAB
COND = UNCOND_TEXT + TEXT_VOCAB
INPUT_VOCAB = COND + COND_ROWS
SPEAKER_DIM = 256
PROMPT_TOKENS = 150  # the voice's prompt speech tokens at most (speech_cond_prompt_len)
SAMPLE_RATE = 24000
TOKENS_PER_SECOND = 25

_COMMON = {
    "codec": "s3gen",  # the codec's name (tests/test_architecture.py)
    "n_codebooks": 1,
    "vocab_size": INPUT_VOCAB,
    "sample_rate": SAMPLE_RATE,
    # Codec windows: 25 tokens (one second) per window, each decoded once in its request's codec
    # stream (programs/chatterbox/codec.py).
    "detok_interval": 25,
    "detok_overlap": 0,
    "detok_samples": SAMPLE_RATE,
    "stop_tokens": [STOP_SPEECH],
    "audio_tokens": [0, SPEECH_CODES],
    "voices": [],  # the checkpoint's default voice (conds.pt), or a cloned one
    "model_options": {
        "exaggeration": "emotion exaggeration, 0 to 2 (default 0.5)",
        "cfg_weight": "classifier-free guidance weight w: cond + w (cond - uncond), 0 to 2 (default 0.5)",
    },
    "refused": {"speed": "Chatterbox cannot change its speaking rate"},
    # ChatterboxTTS.generate's defaults: temperature 0.8, min-p 0.05, top-p 1, repetition penalty 1.2
    # over the speech tokens generated (and the start of speech).
    "sampling": {
        "temperature": 0.8,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "repetition_window": -1,
        "min_tokens": 0,
    },
}

SPECS = {
    "chatterbox": {
        **_COMMON,
        "name": "chatterbox",
        "hf_id": "ResembleAI/chatterbox",
        "codec_id": "ResembleAI/chatterbox",
        "lm_config": "chatterbox-t3.json",
        "codec_config": "chatterbox-s3gen.json",
        "max_tokens": 2048,  # the conditional prompt + up to 1000 speech tokens (the reference's max_new_tokens)
    },
    "chatterbox-tiny": {
        **_COMMON,
        "name": "chatterbox-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "chatterbox-tiny-t3.json",
        "codec_config": "chatterbox-tiny-s3gen.json",
        # the S3 tokenizer's sizes (clone.py; the published one is 128 mels, 1280 wide, 20 heads, 6 layers)
        "s3_tokenizer": {"n_mels": 128, "n_state": 128, "n_head": 2, "n_layer": 2},
        "max_tokens": 1200,
    },
}
