"""chatterbox-tts 0.1.7's T3 (the reference) built from a shipped config with the weights of our
T3LM, for the parity tests.

The package's `__init__` imports the whole TTS; `import_t3` registers the package without running
it, so that only the T3 modules (torch, transformers, einops) are imported. The voice encoder imports
librosa; the S3 tokenizer imports s3tokenizer 0.3 (installed `--no-deps`, with onnx), whose utils
import torchaudio for `load_audio` alone, which the tokenizer never calls. S3Gen's `embed_ref` needs
torchaudio's Kaldi filterbanks and resampler, pure Python both; the torchaudio wheel the registry has
for this torch (2.11.1, installed `--no-deps` into REFERENCE_TORCHAUDIO, off the venv's path) is
built against CUDA, so its C library cannot load on a CPU-only machine: `import_torchaudio` (which
tests/conftest.py runs at the session's start) enters the package without that library, and
registers an empty module under its name where torchaudio is nowhere."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
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


# torchaudio for the reference alone (.ci/run: `pip install --no-deps --target` here), off the venv's
# path: installed in site-packages, its failing import would fail every process that imports
# transformers' models (their audio utilities import torchaudio wherever it is installed), the
# servers the tests start among them.
REFERENCE_TORCHAUDIO = os.path.join(sys.prefix, "reference-torchaudio")


def import_torchaudio() -> bool:
    """torchaudio importable in this process → whether its Python parts (compliance.kaldi,
    functional, transforms) are there. Found on the path or in REFERENCE_TORCHAUDIO (then added to
    the path): the real package where it loads; where its C library cannot load (the registry's
    wheel for this torch is built against CUDA), the package entered without its `__init__` (which
    loads that library and the decoders) and its extension module without the library. Found
    nowhere: an empty module under its name (for the modules that import it without using it)."""
    mod = sys.modules.get("torchaudio")
    if mod is not None and hasattr(mod, "__path__"):
        return True
    spec = importlib.machinery.PathFinder.find_spec("torchaudio")
    if spec is None and os.path.isdir(os.path.join(REFERENCE_TORCHAUDIO, "torchaudio")):
        sys.path.append(REFERENCE_TORCHAUDIO)
        spec = importlib.machinery.PathFinder.find_spec("torchaudio")
    if spec is None:
        if mod is None:
            stub = types.ModuleType("torchaudio")
            stub.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
            sys.modules["torchaudio"] = stub
        return False

    def forget() -> None:  # an empty stub, or what a failed import left
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            del sys.modules[name]

    forget()
    try:
        import torchaudio  # noqa: F401

        return True
    except (ImportError, OSError):  # OSError: "Could not load this library: .../_torchaudio.so"
        forget()
    pkg = types.ModuleType("torchaudio")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    sys.modules["torchaudio"] = pkg
    ext = types.ModuleType("torchaudio._extension")  # a package holding `utils`, not yet the real one
    ext.__path__ = [os.path.join(pkg.__path__[0], "_extension")]
    sys.modules["torchaudio._extension"] = ext
    import torchaudio._extension.utils as utils

    utils._load_lib = lambda lib: False  # the C library: not loaded
    del sys.modules["torchaudio._extension"]
    importlib.import_module("torchaudio._extension")  # the real module, its library skipped
    for name in ("compliance.kaldi", "functional", "transforms"):  # attributes, as the __init__ has them
        importlib.import_module(f"torchaudio.{name}")
    pkg.__version__ = importlib.import_module("torchaudio.version").__version__
    return True


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
    import_torchaudio()
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


def import_s3gen() -> None:
    """chatterbox's `models.s3gen` registered without its `__init__` (which imports the whole S3Gen,
    torchaudio included), so its flow and HiFT modules import alone."""
    import_t3()
    name = "chatterbox.models.s3gen"
    if name not in sys.modules:
        importlib.import_module("chatterbox.models")  # the parent package (its __init__ is empty)

        spec = importlib.util.find_spec(name)
        pkg = types.ModuleType(name)
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules[name] = pkg


def reference_embed_ref(tokenizer, speaker_encoder) -> torch.nn.Module:
    """chatterbox's S3Token2Mel, for its `embed_ref`, holding `tokenizer` (the reference S3Tokenizer:
    `reference_encoders`') and the reference CAMPPlus with the weights of `speaker_encoder` (our
    xvector.CAMPPlus); its flow, which `embed_ref` reads only for its dtype, a float32 stand-in.
    Needs torchaudio's Python parts (`import_torchaudio`)."""
    import_s3gen()
    from chatterbox.models.s3gen.s3gen import S3Token2Mel
    from chatterbox.models.s3gen.utils.mel import mel_spectrogram
    from chatterbox.models.s3gen.xvector import CAMPPlus

    campplus = CAMPPlus(memory_efficient=False).eval()  # as S3Token2Mel builds it
    campplus.load_state_dict(speaker_encoder.state_dict())
    ref = S3Token2Mel.__new__(S3Token2Mel)
    torch.nn.Module.__init__(ref)
    ref.tokenizer, ref.speaker_encoder, ref.mel_extractor = tokenizer, campplus, mel_spectrogram
    ref.flow = torch.nn.Linear(1, 1)
    return ref.eval()


def build_reference_s3gen(cfg: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """chatterbox's CausalMaskedDiffWithXvec and HiFTGenerator (weight norms in place) built as
    S3Token2Wav builds them, with the sizes of an S3Gen config (programs/chatterbox/configs)."""
    import_s3gen()
    from chatterbox.models.s3gen.configs import CFM_PARAMS
    from chatterbox.models.s3gen.decoder import ConditionalDecoder
    from chatterbox.models.s3gen.f0_predictor import ConvRNNF0Predictor
    from chatterbox.models.s3gen.flow import CausalMaskedDiffWithXvec
    from chatterbox.models.s3gen.flow_matching import CausalConditionalCFM
    from chatterbox.models.s3gen.hifigan import HiFTGenerator
    from chatterbox.models.s3gen.transformer.upsample_encoder import UpsampleConformerEncoder

    f, h = cfg["flow"], cfg["hift"]
    enc, est = f["encoder"], f["estimator"]
    encoder = UpsampleConformerEncoder(
        output_size=enc["width"], attention_heads=enc["heads"], linear_units=enc["hidden"],
        num_blocks=enc["blocks"], input_layer="linear", pos_enc_layer_type="rel_pos_espnet",
        selfattention_layer_type="rel_selfattn", input_size=enc["width"], use_cnn_module=False,
        macaron_style=False,
    )  # fmt: skip
    estimator = ConditionalDecoder(
        in_channels=320, out_channels=80, causal=True, channels=[est["channels"]],
        attention_head_dim=est["head_dim"], n_blocks=est["n_blocks"], num_mid_blocks=est["mid_blocks"],
        num_heads=est["heads"], act_fn="gelu",
    )  # fmt: skip
    decoder = CausalConditionalCFM(spk_emb_dim=80, cfm_params=CFM_PARAMS, estimator=estimator)
    flow = CausalMaskedDiffWithXvec(encoder=encoder, decoder=decoder).eval()
    hift = HiFTGenerator(
        sampling_rate=h["sample_rate"], base_channels=h["base_channels"], nb_harmonics=h["harmonics"],
        upsample_rates=h["upsample_rates"], upsample_kernel_sizes=h["upsample_kernels"],
        resblock_kernel_sizes=h["resblock_kernels"], resblock_dilation_sizes=h["resblock_dilations"],
        source_resblock_kernel_sizes=h["source_kernels"],
        source_resblock_dilation_sizes=h["source_dilations"],
        f0_predictor=ConvRNNF0Predictor(cond_channels=h["f0_channels"]),
    ).eval()  # fmt: skip
    return flow, hift


def reference_s3gen(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """`build_reference_s3gen` of `model`'s config (our codec.S3Gen) with its weights (weight norms
    removed, so that the weights are ours exactly)."""
    from torch.nn.utils import parametrize

    flow, hift = build_reference_s3gen(model.cfg)
    for module in hift.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight")
    own = model.state_dict()
    flow.load_state_dict({k[len("flow.") :]: v for k, v in own.items() if k.startswith("flow.")})
    hift.load_state_dict({k[len("mel2wav.") :]: v for k, v in own.items() if k.startswith("mel2wav.")})
    return flow, hift


def reference_decode(flow, hift, model, tokens: torch.Tensor, noise: dict[str, torch.Tensor]) -> torch.Tensor:
    """S3Token2Wav.inference of `tokens` [T] with the voice of `model` (our S3Gen), its random
    numbers replaced by ours: `noise` holds the flow's starting noise `flow` [1, 80, F], HiFT's
    phases `phases` [1, 9] and its source noise `source` [1, 9, S]."""
    from unittest import mock

    import chatterbox.models.s3gen.hifigan as hifigan

    def randn_like(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        for name in ("flow", "source"):
            if noise[name].shape == t.shape:
                return noise[name].clone()
        return torch.zeros_like(t)  # the source module's own noise, which its output does not use

    class Uniform:
        def __init__(self, low, high) -> None:
            pass

        def sample(self, sample_shape):
            return noise["phases"].reshape(sample_shape).clone()

    p = len(model.prompt_tokens)
    dev = tokens.device
    fade = torch.zeros(960, device=dev)
    fade[480:] = (torch.cos(torch.linspace(torch.pi, 0, 480, device=dev)) + 1) / 2
    with mock.patch("torch.randn_like", randn_like), mock.patch.object(hifigan, "Uniform", Uniform):
        mel, _ = flow.inference(
            token=tokens[None],
            token_len=torch.tensor([len(tokens)], device=dev),
            prompt_token=model.prompt_tokens[None],
            prompt_token_len=torch.tensor([p], device=dev),
            prompt_feat=model.prompt_mel.T[None],
            prompt_feat_len=None,
            embedding=model.xvector[None],
            finalize=True,
            n_timesteps=10,
        )
        wav, _ = hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=dev))
    wav = wav[0].clone()
    wav[: len(fade)] *= fade[: len(wav)]
    return wav
