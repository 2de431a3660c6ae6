"""chatterbox-tts 0.1.7's T3 (the reference) built from a shipped config with the weights of our
T3LM, for the parity tests.

The package's `__init__` imports the whole TTS (S3Gen needs torchaudio, which the venv lacks: its
registry wheel is built against CUDA); `import_t3` registers the package without running it, so
that only the T3 modules (torch, transformers, einops) are imported."""

from __future__ import annotations

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
