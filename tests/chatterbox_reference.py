"""chatterbox-tts 0.1.7's T3 (the reference) built from a shipped config with the weights of our
T3LM, for the parity tests.

The package's `__init__` imports the whole TTS (S3Gen needs torchaudio, which the venv lacks: its
registry wheel is built against CUDA); `import_t3` registers the package without running it, so
that only the T3 modules (torch, transformers, einops) are imported. The voice encoder imports
librosa; the S3 tokenizer imports s3tokenizer 0.3 (installed `--no-deps`, with onnx), whose utils
import torchaudio for `load_audio` alone, which the tokenizer never calls: `reference_encoders`
registers an empty module under that name where torchaudio is missing."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch


def import_t3() -> None:
    """The `chatterbox` package registered without its `__init__`, so its T3 imports alone."""
    if "chatterbox" not in sys.modules:
        spec = importlib.util.find_spec("chatterbox")
        pkg = types.ModuleType("chatterbox")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["chatterbox"] = pkg


def reference_t3(lm) -> torch.nn.Module:
    """chatterbox's T3 with the config and weights of `lm` (a T3LM)."""
    import_t3()
    from chatterbox.models.t3 import T3
    from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
    from chatterbox.models.t3.modules.t3_config import T3Config

    cfg = lm.config
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling")
    LLAMA_CONFIGS["voxpipe-test"] = {**LLAMA_CONFIGS["Llama_520M"], **{k: cfg[k] for k in keys}}
    hp = T3Config.english_only()
    hp.llama_config_name = "voxpipe-test"
    hp.max_text_tokens, hp.max_speech_tokens = cfg["max_text_tokens"], cfg["max_speech_tokens"]
    ref = T3(hp).eval()
    missing, unexpected = ref.load_state_dict(lm.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"tfmr.embed_tokens.weight", "text_head.weight"}, (
        missing,
        unexpected,
    )
    return ref


def reference_encoders(speaker_encoder, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """chatterbox's VoiceEncoder and S3Tokenizer with the weights (and the tokenizer's sizes) of our
    clone.VoiceEncoder and clone.S3Tokenizer. The reference S3Tokenizer's constructor builds the
    published sizes whatever config it is given, so a smaller one is built as that constructor
    does: S3TokenizerV2 of the config, then its mel filters and window."""
    import_t3()
    if importlib.util.find_spec("torchaudio") is None and "torchaudio" not in sys.modules:
        stub = types.ModuleType("torchaudio")
        stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stub
    import librosa
    from chatterbox.models.s3tokenizer import S3Tokenizer
    from chatterbox.models.voice_encoder import VoiceEncoder
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    ve = VoiceEncoder().eval()
    ve.load_state_dict(speaker_encoder.state_dict())
    c = tokenizer.cfg
    config = ModelConfig(
        n_mels=c["n_mels"], n_audio_state=c["n_state"], n_audio_head=c["n_head"], n_audio_layer=c["n_layer"]
    )
    tok = S3Tokenizer.__new__(S3Tokenizer)
    S3TokenizerV2.__init__(tok, "speech_tokenizer_v2_25hz", config)
    tok.n_fft = 400
    tok.register_buffer(
        "_mel_filters", torch.FloatTensor(librosa.filters.mel(sr=16000, n_fft=400, n_mels=c["n_mels"]))
    )
    tok.register_buffer("window", torch.hann_window(400))
    missing, unexpected = tok.load_state_dict(tokenizer.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"_mel_filters", "window"}, (missing, unexpected)
    return ve, tok.eval()
