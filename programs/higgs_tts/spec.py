"""Higgs Audio v2 constants, torch-free (the gateway and tokenizer workers read them): ids, the
prompt template, the delay pattern's markers, sampling defaults, and SPECS, the served variants.

Facts from transformers' port, the reference here (models/higgs_audio_v2: modeling, generation,
the processor and the chat template of convert_higgs_audio_v2_to_hf.py), and bosonai's published
config.json (configs/, see docs/models/higgs-tts.md for where each value comes from):

- a prompt is Llama-3 ChatML text: `<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n`
  + the system message + (`\\n\\n<|scene_desc_start|>\\n` + scene + `\\n<|scene_desc_end|>`) +
  `<|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\n` + text + `<|eot_id|>` +
  `<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>`; every prompt row is text;
- a cloned voice comes before the user's turn as a user turn of the clip's transcript and an
  assistant turn of its audio: `<|audio_out_bos|>`, the clip's codes framed by a stream bos and eos
  frame in the delay pattern (T + 9 rows for T frames, audio rows: the audio embedding and the audio
  feed-forward), `<|audio_eos|><|eot_id|>`;
- each generated row holds 8 codebooks of 1026 ids (1024 codes, stream bos 1024, stream eos 1025),
  all 8 from one hidden state (`audio_lm_head`), in a delay pattern: codebook k lags k rows. Row r
  forces stream bos in codebooks k >= r; once any codebook has sampled eos (row t), row t + 1 + k
  forces eos in codebooks 0..k; generation stops at the first row that is all eos;
- the audio is frames f = 0.. of codebook k at row f + k + 1 (the reference's revert_delay_pattern
  between the last all-bos row and the first all-eos row), codes clipped to [0, 1023], decoded by
  the tokenizer's acoustic (DAC) decoder: 24 kHz, 25 frames/s, 960 samples a frame.

Row values the program adds (never sampled; `embed` reads them as stream eos, the codec clips them):
FORCED_EOS marks an eos the delay pattern forced (so a row's forced prefix is counted exactly from
the previous row alone), and FLUSH_BASE + j (column 0) marks the j-th row after the all-eos row:
the codec's decoder runs `decoder_lag` frames behind its input, so the request runs that many rows past
the reference's stop (rows that only flush the codec; the LM's codes are the reference's), and the
row with j = lookahead is the stop.
"""

from __future__ import annotations

import math
from typing import Any

N_CODEBOOKS = 8
CODEBOOK_IDS = 1026  # ids per codebook in the LM: 1024 codes, stream bos, stream eos
CODES = 1024
STREAM_BOS = 1024
STREAM_EOS = 1025
FORCED_EOS = 1026  # an eos the delay pattern forced (see the module docstring)
FLUSH_BASE = 2048  # column 0 of the j-th flush row: FLUSH_BASE + j
TEXT_VOCAB = 128256
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 960  # 24 kHz / 25 Hz

# Llama-3 special tokens (bosonai's tokenizer: reserved slots renamed for audio)
BEGIN_OF_TEXT = 128000
START_HEADER = 128006
END_HEADER = 128007
EOT = 128009
AUDIO_OUT_BOS = 128013  # <|audio_out_bos|>: the prompt's last token
AUDIO_OUT = 128016  # <|AUDIO_OUT|>: the reference's placeholder of an audio row in a prompt
AUDIO_DELAY = 128014  # <|reserved_special_token_6|>: the placeholder of its last 7 rows
AUDIO_EOS = "<|audio_eos|>"  # closes a prompt's audio (id from the tokenizer)
# A prompt's audio row (a cloned voice's clip): every column PROMPT_AUDIO + its codebook's id, so a
# prompt row is text (column 0 the id, the rest 0) or audio (every column >= PROMPT_AUDIO)
PROMPT_AUDIO = 4096
# Repetition-aware sampling (the published generation_config.json: ras_win_len 7,
# ras_win_max_num_repeat 2): a codebook's draw that its last RAS_WINDOW audio rows already hold
# RAS_MAX_REPEAT times or more (stream bos and eos not counted) is drawn again from the raw logits.
RAS_WINDOW, RAS_MAX_REPEAT = 7, 2
RAS_SALT = 8  # the redraws' salts: RAS_SALT + codebook (codebooks 1..7 draw with salts 1..7)

SYSTEM_MESSAGE = "Generate audio following instruction."
DEFAULT_SCENE = "Audio is recorded from a quiet room."
SCENE_START = "<|scene_desc_start|>"
SCENE_END = "<|scene_desc_end|>"


def decoder_lag(acoustic: dict[str, Any]) -> tuple[int, int]:
    """(samples, frames): how far the DAC decoder's output runs behind its input when it decodes a
    stream (programs/higgs_tts/codec.py), every convolution being centered: a conv of kernel k and
    dilation d waits for (k - 1) d / 2 inputs past its output, a transposed conv (kernel 2s,
    stride s, padding ceil(s/2)) turns a lag of m inputs into m s + ceil(s/2) outputs; the frames
    are the samples rounded up to whole frames (9458 samples, 10 frames with the published ratios)."""
    ratios = list(acoustic["upsampling_ratios"])
    lag = 3  # the first conv (kernel 7), in latent frames
    for s in ratios:
        lag = lag * s + math.ceil(s / 2) + 3 * (1 + 3 + 9)  # transposed conv, residual units
    lag += 3  # the last conv
    hop = math.prod(ratios)
    return lag, -(-lag // hop)


_COMMON = {
    "codec": "higgs-audio-v2-tokenizer",  # the codec's name (tests/test_architecture.py)
    "n_codebooks": N_CODEBOOKS,
    "vocab_size": CODEBOOK_IDS,
    "sample_rate": SAMPLE_RATE,
    # Codec streams (programs/base.py): each row goes to the codec once, as a window of one row,
    # which emits one frame (960 samples, 40 ms) once the frame and its look-ahead exist.
    "detok_interval": 1,
    "detok_overlap": 0,
    "detok_samples": SAMPLES_PER_FRAME,
    "stop_tokens": [],  # the stop is decided on the whole row (HiggsTtsProgram.classify)
    "audio_tokens": [0, CODES],
    "voices": [],  # no preset voices: the scene description says what the voice is like
    "model_options": {
        "scene": "the scene description (default: 'Audio is recorded from a quiet room.'); "
        "the voice's description goes here, e.g. 'SPEAKER0: feminine, warm'",
        "system": f"the system message (default: {SYSTEM_MESSAGE!r})",
    },
    "refused": {"speed": "Higgs Audio cannot change its speaking rate"},
    # bosonai's examples/generation.py defaults (temperature 1.0, top_k 50, top_p 0.95), with its
    # repetition-aware sampling (RAS_WINDOW, RAS_MAX_REPEAT below) on every request.
    "sampling": {
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 0.95,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "repetition_window": -1,
        "min_tokens": 0,
    },
}

SPECS = {
    "higgs-tts": {
        **_COMMON,
        "name": "higgs-tts",
        "hf_id": "bosonai/higgs-audio-v2-generation-3B-base",
        "codec_id": "bosonai/higgs-audio-v2-tokenizer",
        "lm_config": "higgs-audio-v2-generation-3b-base.json",
        "codec_config": "higgs-audio-v2-tokenizer.json",
        "max_tokens": 4096,  # prompt + rows: ~160 s of audio
    },
    "higgs-tts-tiny": {
        **_COMMON,
        "name": "higgs-tts-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "higgs-tts-tiny.json",
        "codec_config": "higgs-audio-v2-tokenizer-tiny.json",
        "max_tokens": 600,
    },
}
