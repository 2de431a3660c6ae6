"""Orpheus constants, torch-free (the gateway and tokenizer workers read them).

Facts checked against the public reference (canopylabs/orpheus-tts and its decoder):
prompt `[128259] + tokenize(f"{voice}: {text}") + [128009, 128260, 128261, 128257]`, stop token
128258, audio token t at frame position k is SNAC code t - 128266 - 4096*k, a 28-token window
decoded every 7 tokens keeping samples [2048:4096].
"""

AUDIO_BASE = 128266  # <custom_token_10>: SNAC code 0 at frame position 0
CODEBOOK = 4096
FRAME = 7  # tokens per SNAC frame (1 + 2 + 4 codes)
STOP_TOKEN = 128258
VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]

_COMMON = {
    "codec": "snac",  # the codec's name (tests/test_architecture.py keeps it out of the runtime)
    "n_codebooks": 1,
    "vocab_size": 156940,
    "sample_rate": 24000,
    "detok_interval": 28,  # 4 frames per SNAC window
    "detok_overlap": 21,  # a new window every 7 tokens (one frame)
    "detok_samples": 2048,  # the reference keeps samples [2048:4096] of each window
    "detok_lead": [7, 14, 21],  # a first chunk of 1-3 frames, decoded whole (L * 2048 samples)
    "detok_tail": True,  # progressive first chunks: frame k from frames max(0, k-3)..k, last kept
    "detok_offset": 7,  # so window j is the audio of frame j + 1 (rows [7j + 7, 7j + 14))
    "stop_tokens": [STOP_TOKEN],
    "audio_tokens": [AUDIO_BASE, AUDIO_BASE + FRAME * CODEBOOK],
    "prefix_ids": [128259],
    "suffix_ids": [128009, 128260, 128261, 128257],
    "bos_id": 128000,
    "text_template": "{voice}: {text}",
    "voices": VOICES,
    "default_voice": "tara",
    # OpenAI request fields the model cannot honour, and why (the gateway refuses other values).
    "refused": {
        "speed": "Orpheus cannot change its speaking rate",
        "instructions": "Orpheus takes no voice instructions",
    },
    "max_tokens": 1200,
    "sampling": {
        "temperature": 0.6,
        "top_k": 0,
        "top_p": 0.8,
        "min_p": 0.0,
        "repetition_penalty": 1.3,
        "repetition_window": -1,
    },
}

SPECS = {
    "orpheus": {
        **_COMMON,
        "name": "orpheus",
        "hf_id": "canopylabs/orpheus-3b-0.1-ft",
        "codec_id": "hubertsiuzdak/snac_24khz",
        "lm_config": "orpheus-3b.json",  # in programs/orpheus/configs/, for --load-format dummy
        "codec_config": "snac_24khz.json",
        "constrained": False,
        "constrainable": True,
    },
    "orpheus-tiny": {
        **_COMMON,
        "name": "orpheus-tiny",
        "hf_id": None,  # always random weights: built on the spot, no download
        "codec_id": None,
        "lm_config": "orpheus-tiny.json",
        "codec_config": "snac-tiny.json",
        # Random weights rarely sample a valid code for the frame position; constrained sampling
        # keeps the stream decodable so the tiny model returns audio of the expected length.
        "constrained": True,
        "constrainable": True,
        "max_tokens": 400,
    },
}
