"""Qwen3-TTS constants, torch-free: what the model's spec.py (SPECS, registered in programs/__init__.py
with the program that serves it) and its prompt builder take their ids and defaults from.

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
