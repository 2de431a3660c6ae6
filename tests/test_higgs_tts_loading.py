"""Higgs Audio v2 checkpoints load into the program's modules: transformers' layout as its
`save_pretrained` writes it (the LM; the tokenizer with weight-normed convolutions, which load
folded), and bosonai's original LM layout (`HiggsAudioModel`'s names, the partially frozen
embedding and audio head halves, its config.json with `text_config`) through the mapping of
transformers' converter. Tiny random models; the loaded modules compute what the reference does."""

from __future__ import annotations

import json

import numpy as np
import safetensors.torch
import torch

from programs import get_spec, load_program_class
from programs.higgs_tts import spec as h
from programs.higgs_tts.codec import HiggsCodec
from programs.higgs_tts.model import HiggsLM
from tests.higgs_tts_reference import reference_lm, reference_tokenizer

PROGRAM = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")


def random_lm() -> HiggsLM:
    lm = HiggsLM(PROGRAM.read_config("lm_config"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, t in lm.named_parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.05)
    return lm


def test_the_transformers_checkpoint_loads(tmp_path):
    lm = random_lm()
    reference_lm(lm).save_pretrained(tmp_path)
    loaded = HiggsLM.from_pretrained(str(tmp_path), torch.float32, "cpu")
    for name, t in lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_the_original_bosonai_checkpoint_loads(tmp_path):
    lm = random_lm()
    cfg = lm.config
    original = {}
    for name, t in lm.state_dict().items():
        if name == "model.embed_tokens.weight":  # frozen rows, then the trainable ones
            original["embed_tokens.embedding_frozen.weight"] = t[:128000]
            original["embed_tokens.embedding_trainable.weight"] = t[128000:]
        elif name == "audio_lm_head.weight":
            original["audio_decoder_proj.audio_lm_head.linear_frozen.weight"] = t[:5000]
            original["audio_decoder_proj.audio_lm_head.linear_trainable.weight"] = t[5000:]
        elif name == "model.embed_audio_tokens.embed_audio_tokens.weight":
            original["audio_codebook_embeddings.weight"] = t
        else:
            original[name.removeprefix("model.")] = t
    original["audio_codebook_weights"] = torch.ones(cfg["num_codebooks"])  # training only: passed over
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in original.items()}, tmp_path / "model.safetensors"
    )
    text_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    text = {k: cfg[k] for k in (*text_keys, "num_key_value_heads", "head_dim", "rms_norm_eps")}
    text.update(
        rope_theta=500000.0,
        rope_scaling={k: v for k, v in cfg["rope_parameters"].items() if k != "rope_theta"},
    )
    config = {
        "text_config": text,
        "audio_num_codebooks": 8,
        "audio_codebook_size": 1024,
        "model_type": "higgs_audio",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = HiggsLM.from_pretrained(str(tmp_path), torch.float32, "cpu")
    for name, t in lm.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    assert torch.equal(loaded.inv_freq, lm.inv_freq)


def test_the_tokenizer_checkpoint_loads_with_its_weight_norm_folded(tmp_path):
    path = PROGRAM.config_path("codec_config")
    ref = reference_tokenizer(HiggsCodec.from_config(path, torch.float32, "cpu"), path)
    ref.apply_weight_norm()  # the published checkpoint's layout
    state = ref.state_dict()
    assert any("parametrizations.weight.original1" in k for k in state)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")
    with open(path) as f:
        (tmp_path / "config.json").write_text(f.read())
    codec = HiggsCodec.from_pretrained(str(tmp_path), torch.float32, "cpu")
    codes = torch.from_numpy(np.random.default_rng(2).integers(0, h.CODES, (9, 8)))
    with torch.no_grad():
        want = ref.decode(codes.T[None], return_dict=False)[0, 0]
    assert (codec.decode_all(codes) - want).abs().max() < 1e-5
