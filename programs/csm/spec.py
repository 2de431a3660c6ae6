"""CSM constants, torch-free (the gateway and tokenizer workers read them).

Facts from transformers' CSM port (models/csm: modeling, generation and the processor's chat
template), which is the reference here:
- a prompt is one turn per message, `<|begin_of_text|>[{speaker}]{text}<|end_of_text|>`, and a
  turn that carries audio is followed by one frame per audio frame and an all-zero frame (the
  processor's `<|AUDIO|>`…`<|audio_eos|>`); the turn to speak is the last one, text only;
- each generated frame is 32 Mimi codes: codebook 0 from the backbone, 1..31 from the depth
  decoder; generation stops on a frame whose codebooks 0..30 are all 0 (`codebook_eos_token_id`);
- audio is Mimi (kyutai/mimi, 24 kHz, 12.5 frames/s, 1920 samples a frame).

Row layout (n_codebooks = 32 columns): an audio row is a frame of 32 codes in [0, 2051); a text row
holds the text token in column 0 and TEXT_MARK (2051, outside the audio vocabulary) in every other
column, so `embed` tells them apart on the device.
"""

AUDIO_VOCAB = 2051  # codes per codebook in the LM (Mimi's 2048 + 3 specials)
TEXT_MARK = AUDIO_VOCAB
N_CODEBOOKS = 32
BOS_ID = 128000
EOS_ID = 128001  # <|end_of_text|>, closes every turn's text
SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 Hz
SPEAKERS = [str(i) for i in range(10)]

_COMMON = {
    "codec": "mimi",  # the codec's name (tests/test_architecture.py keeps it out of the runtime)
    "n_codebooks": N_CODEBOOKS,
    "vocab_size": AUDIO_VOCAB,
    "sample_rate": 24000,
    # Codec streams (programs/base.py): Mimi decodes each frame once, keeping every request's
    # decoder state in a codec slot, so a window is one frame, 80 ms of audio, and the stream's
    # audio is MimiModel.decode of the whole utterance.
    "detok_interval": 1,
    "detok_overlap": 0,
    "detok_samples": SAMPLES_PER_FRAME,
    # Codebook-0 code 0 is what a stop frame starts with: the sampler masks it until min_tokens
    # (the stop itself is decided on the whole frame, in CsmProgram.classify).
    "stop_tokens": [0],
    "audio_tokens": [0, 2048],
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "suffix_ids": [EOS_ID],  # after a turn's text (the gateway counts it when it sizes segments)
    "voices": SPEAKERS,  # CSM speaker ids; the OpenAI `voice` field picks one
    "default_voice": "0",
    "text_template": "[{voice}]{text}",
    # Request options beyond voice (gateway fields, passed to preprocess as model_kwargs).
    "model_options": {
        "context": "CSM conversation context: a JSON list of earlier turns, "
        '[{"speaker": 1, "text": "...", "codes": [[32 Mimi codes], ...]}], each with its audio as Mimi '
        "codes (the reference's template gives every context turn audio).",
    },
    # OpenAI request fields the model cannot honour, and why (the gateway refuses other values).
    "refused": {
        "speed": "CSM cannot change its speaking rate",
        "instructions": "CSM takes no voice instructions",
    },
    "max_tokens": 2048,  # frames, prompt included: the backbone's max_position_embeddings
    # sesame/csm-1b's generation_config: sampling with temperature 0.9 and top_k 50, for the
    # backbone and the depth decoder alike (both sets of settings are the request's here).
    "sampling": {
        "temperature": 0.9,
        "top_k": 50,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "repetition_window": -1,
    },
}

SPECS = {
    "csm": {
        **_COMMON,
        "name": "csm",
        "hf_id": "sesame/csm-1b",
        "codec_id": "sesame/csm-1b",  # the checkpoint carries Mimi under codec_model.*
        "lm_config": "csm-1b.json",  # in programs/csm/configs/, for --load-format dummy
        "codec_config": "mimi.json",
    },
    "csm-tiny": {
        **_COMMON,
        "name": "csm-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "csm-tiny.json",
        "codec_config": "mimi-tiny.json",
        "max_tokens": 400,
    },
}
