"""Qwen3-TTS constants, torch-free (the gateway and tokenizer workers read them): ids, speakers,
languages, sampling defaults, and SPECS, the served variants.

Facts from the reference, qwen-tts 0.1.1 / qwen-tts-compat 0.1.1.post1
(qwen_tts/core/models/modeling_qwen3_tts.py `Qwen3TTSForConditionalGeneration.generate`,
qwen_tts/inference/qwen3_tts_model.py) and the published config.json (configs/):

- text: Qwen2's BPE; a request's text is `ASSISTANT_TEMPLATE`, an instruction `INSTRUCT_TEMPLATE`;
  the text to speak is the assistant text's tokens [3:-5] (between `<|im_start|>assistant\\n` and
  `<|im_end|>\\n<|im_start|>assistant\\n`);
- the talker's prompt is embeddings: [instruction text rows] + the 3 role rows + the codec prefix
  (`THINK, THINK_BOS, language, THINK_EOS`, or `NOTHINK, THINK_BOS, THINK_EOS` for language "auto";
  then the speaker's id if any; then `CODEC_PAD, CODEC_BOS`), each codec row before `CODEC_BOS`
  summed with a text row: the tts pad row, and the tts bos row on `CODEC_PAD`;
  - non-streaming text (the reference's default): the text rows and a tts eos row, each plus the
    `CODEC_PAD` embedding, then tts pad + `CODEC_BOS`; every frame's text column is the tts pad row;
  - streaming text: the first text row plus `CODEC_BOS`; frame j's text column is text row j + 1
    (then the tts eos row, then tts pad);
- a frame is 16 codes: codebook 0 from the talker (codec ids 2048..3071 are never sampled but
  `CODEC_EOS`, which ends the request and is no audio; it is masked for the first `MIN_FRAMES`),
  1..15 from the code predictor;
- speaker and dialect: a speaker with a dialect speaking "chinese" or "auto" uses the dialect's
  language id; the 0.6B CustomVoice model takes no instruction (the reference drops it).

Row layout (n_codebooks = 16 columns): a generated row is a frame of 16 codes (codebook 0 in
[0, 3072), the others in [0, 2048)). A prompt row holds `[codec id, text id, kind, 0, …]`, where
the kind in column 2 (never a code) is PROMPT_TEXT (the text row alone: instruction and role rows,
column 0 then holds CODEC_PAD, never read) or PROMPT_BOTH (text row + codec row), so `embed` tells
them apart on the device.
"""

N_CODEBOOKS = 16
CODE_VOCAB = 2048  # codes per codebook: codebook 0 shares the talker's 3072 ids with the specials
TALKER_VOCAB = 3072
SAMPLE_RATE = 24000
FRAME_RATE = 12.5  # frames per second (Qwen3-TTS-Tokenizer-12Hz)

# Text ids (Qwen2 vocabulary, 151936 ids; config.json)
IM_START_ID = 151644
IM_END_ID = 151645
ASSISTANT_ID = 77091
TTS_PAD_ID = 151671
TTS_BOS_ID = 151672
TTS_EOS_ID = 151673

# Codec ids (talker_config)
CODEC_PAD = 2148
CODEC_BOS = 2149
CODEC_EOS = 2150
THINK = 2154
NOTHINK = 2155
THINK_BOS = 2156
THINK_EOS = 2157

ASSISTANT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
INSTRUCT_TEMPLATE = "<|im_start|>user\n{instruct}<|im_end|>\n"

# CustomVoice speakers (talker_config.spk_id, spk_is_dialect), names as the reference lowercases them.
SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
SPEAKER_DIALECT = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}

# talker_config.codec_language_id; the dialects are ids only a dialect speaker reaches (the
# reference lists every language without "dialect" in its name, and "auto").
LANGUAGES = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}

# Sampling defaults: the checkpoints' generation_config.json, which equals the reference wrapper's
# own defaults (used where that file gives none) but for max_new_tokens (the wrapper's: 2048).
MIN_FRAMES = 2  # min_new_tokens: CODEC_EOS cannot end the first two frames
TALKER_SAMPLING = {
    "temperature": 0.9,
    "top_k": 50,
    "top_p": 1.0,
    "repetition_penalty": 1.05,  # over the request's generated codebook-0 ids (transformers' processor)
    "max_new_tokens": 8192,
}
PREDICTOR_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0}

# Prompt rows (see the row layout above): column 2 says which tracks a prompt row holds.
PROMPT_TEXT = CODE_VOCAB  # the text track alone
PROMPT_BOTH = CODE_VOCAB + 1  # text track + codec track
# Base (voice cloning, programs/qwen3_tts/clone.py): rows whose codec track is per-request state.
PROMPT_SPEAKER = CODE_VOCAB + 2  # text track + the request's speaker vector ("speaker" state)
PROMPT_REF = CODE_VOCAB + 3  # text track + frame `column 0` of the request's clip ("codes" state)
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz

_COMMON = {
    "codec": "qwen3-tts-tokenizer",  # the codec's name (tests/test_architecture.py)
    "n_codebooks": N_CODEBOOKS,
    "vocab_size": TALKER_VOCAB,
    "sample_rate": SAMPLE_RATE,
    # The codec decodes each frame once, as a stream with state per request (the program's
    # codec_streams): a window is one frame, 80 ms of audio.
    "detok_interval": 1,
    "detok_overlap": 0,
    "detok_samples": SAMPLES_PER_FRAME,
    "stop_tokens": [CODEC_EOS],
    "audio_tokens": [0, CODE_VOCAB],
    "languages": [name.capitalize() for name in LANGUAGES if "dialect" not in name],
    "max_tokens": 2400,  # prompt + frames: the reference wrapper's 2048 frames (164 s) and a long prompt
    "sampling": {
        "temperature": TALKER_SAMPLING["temperature"],
        "top_k": TALKER_SAMPLING["top_k"],
        "top_p": TALKER_SAMPLING["top_p"],
        "min_p": 0.0,
        "repetition_penalty": TALKER_SAMPLING["repetition_penalty"],
        "repetition_window": -1,
        "min_tokens": MIN_FRAMES,
    },
    "refused": {"speed": "Qwen3-TTS cannot change its speaking rate"},
}

_CUSTOM_VOICE = {
    **_COMMON,
    "voices": list(SPEAKERS),
    "default_voice": "vivian",
    "model_options": {
        "non_streaming_mode": "true (default): the whole text is in the prompt; false: the text "
        "enters as the audio goes, one token per frame (the reference's streaming text mode)",
    },
}

# Base: a voice cloned from a reference clip (x-vector, and in-context the clip's frames and words).
_BASE = {
    **_COMMON,
    "voices": [],  # the voice is the request's clip, or a saved voice
    "instructions": False,
    "refused": {
        **_COMMON["refused"],
        "instructions": "the Base model clones a voice and takes no instructions",
    },
    "reference_sample_rate": SAMPLE_RATE,  # the encoders' rate (speaker encoder and 12 Hz encoder)
    "max_ref_frames": 375,  # an in-context clip of at most 30 s
    "max_ref_text": 256,  # its transcript's text ids
    "max_tokens": 3072,  # the wrapper's 2048 frames, a long text and an in-context clip
    "model_options": {
        "x_vector_only_mode": "false (default): the clip's frames and transcript are in context "
        "(ICL, needs ref_text); true: the speaker's x-vector alone",
        "non_streaming_mode": "false (default, the reference's for cloning): the text enters as the "
        "audio goes; true: the whole text is in the prompt",
    },
}

# The settings the CustomVoice and VoiceDesign checkpoints serve with unless told otherwise
# (`common.options.model_defaults`): the talker and predictor in fused kernels, each step launched
# as the one before it ends, a prompt that arrives while a step runs started beside it in one of
# two prompt lanes, a busy codec decoding a stream's waiting frames as one window. On one H200
# (Poisson arrivals, MPS with the codec unrestricted) the 1.7B keeps TTFA p95 at 28-33 ms at 20
# req/s and 47 ms at 60 with every request on time, 77 ms at 80 (1 of 961 late); the 0.6B (measured
# with one lane) 61 ms at 80 req/s, where the runtime's defaults give it 446 ms and 99.1 % on time
# (docs/models/qwen3-tts.md, Serving settings). The Base models' cloning prompts are unmeasured with them on a GPU: they serve
# with the runtime's defaults.
_SERVE = {"fused_step": "on", "late_launch": "on", "prompt_lane": "on", "prompt_lanes": 2, "codec_merge": 8}

SPECS = {
    "qwen3-tts": {
        **_CUSTOM_VOICE,
        "name": "qwen3-tts",
        "serve_defaults": _SERVE,
        "hf_id": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
        "codec_id": "Qwen/Qwen3-TTS-Tokenizer-12Hz",
        "lm_config": "qwen3-tts-12hz-1.7b-customvoice.json",
        "codec_config": "qwen3-tts-tokenizer-12hz.json",
        "instructions": True,
    },
    "qwen3-tts-0.6b": {
        **_CUSTOM_VOICE,
        "name": "qwen3-tts-0.6b",
        "serve_defaults": _SERVE,
        "hf_id": "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
        "codec_id": "Qwen/Qwen3-TTS-Tokenizer-12Hz",
        "lm_config": "qwen3-tts-12hz-0.6b-customvoice.json",
        "codec_config": "qwen3-tts-tokenizer-12hz.json",
        "instructions": False,  # the reference drops the 0.6B CustomVoice model's instruction
        "refused": {**_COMMON["refused"], "instructions": "the 0.6B CustomVoice model takes no instructions"},
    },
    "qwen3-tts-voicedesign": {
        **_COMMON,
        "name": "qwen3-tts-voicedesign",
        "serve_defaults": _SERVE,
        "hf_id": "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
        "codec_id": "Qwen/Qwen3-TTS-Tokenizer-12Hz",
        "lm_config": "qwen3-tts-12hz-1.7b-voicedesign.json",
        "codec_config": "qwen3-tts-tokenizer-12hz.json",
        "voices": [],  # the voice is the instructions' description
        "instructions": True,
        "model_options": dict(_CUSTOM_VOICE["model_options"]),
    },
    "qwen3-tts-base": {
        **_BASE,
        "name": "qwen3-tts-base",
        "hf_id": "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
        "codec_id": "Qwen/Qwen3-TTS-Tokenizer-12Hz",
        "lm_config": "qwen3-tts-12hz-1.7b-base.json",
        "codec_config": "qwen3-tts-tokenizer-12hz.json",
    },
    "qwen3-tts-base-0.6b": {
        **_BASE,
        "name": "qwen3-tts-base-0.6b",
        "hf_id": "Qwen/Qwen3-TTS-12Hz-0.6B-Base",
        "codec_id": "Qwen/Qwen3-TTS-Tokenizer-12Hz",
        "lm_config": "qwen3-tts-12hz-0.6b-base.json",
        "codec_config": "qwen3-tts-tokenizer-12hz.json",
    },
    "qwen3-tts-base-tiny": {
        **_BASE,
        "name": "qwen3-tts-base-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "qwen3-tts-base-tiny.json",
        "codec_config": "qwen3-tts-tokenizer-tiny.json",
        "max_tokens": 800,
        "max_ref_frames": 40,
        "max_ref_text": 64,
    },
    "qwen3-tts-tiny": {
        **_CUSTOM_VOICE,
        "name": "qwen3-tts-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "qwen3-tts-tiny.json",
        "codec_config": "qwen3-tts-tokenizer-tiny.json",
        "instructions": True,
        "max_tokens": 600,
    },
}
