"""S3Gen's part of a cloned Chatterbox voice (clone.py `s3gen_voice`: the 24 kHz prompt mel, the
prompt tokens, the CAM++ x-vector of xvector.py) equals chatterbox-tts 0.1.7's
`S3Gen.embed_ref(clip[:10 s], 16000)` with the same random weights (the tiny S3 tokenizer as the
program's dummy encoders have it; CAM++ at its real size, every weight and running statistic
random): equal tokens, the mel and the x-vector within 1e-4 of their scale, for clips of 45 ms (the
shortest whose x-vector is finite), 2.03 s (a mel frame past a whole token: the reference cuts its
tokens to the mel's and keeps the odd frame, which our [2P, 80] leaves out) and 12 s (cut to 10 s).

The reference needs torchaudio's Kaldi filterbanks and resampler: the test skips where torchaudio is
neither installed nor in .venv/reference-torchaudio (.ci/run: `pip install --no-deps --target
.venv/reference-torchaudio torchaudio==2.11.1`; tests/chatterbox_reference.py enters it without its
C library, which needs CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from programs import get_spec, load_program_class
from programs.chatterbox.clone import s3gen_voice
from programs.chatterbox.xvector import MIN_SAMPLES, CAMPPlus, speaker_encoder
from tests.chatterbox_reference import import_torchaudio, reference_embed_ref, reference_encoders

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def clip(samples: int, seed: int) -> np.ndarray:
    """A speech-like 16 kHz clip: harmonics of a gliding pitch and low-passed noise under a
    syllable-rate envelope, each seed its own pitch, rate and noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(samples) / 16000
    f0 = 100 + 80 * gen.random() + 25 * np.sin(2 * np.pi * 0.6 * t + 6 * gen.random())
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    voiced = sum(np.sin(k * phase) * gen.random() / k for k in range(1, 12))
    noise = np.convolve(gen.standard_normal(samples), np.hanning(7) / 3, mode="same")
    envelope = 0.3 + 0.7 * np.sin(2 * np.pi * (2 + 3 * gen.random()) * t) ** 2
    return (0.15 * envelope * (voiced + (0.2 + 0.6 * gen.random()) * noise)).astype(np.float32)


@pytest.fixture(scope="module")
def encoders():
    """(our tokenizer, our CAMPPlus, the reference's S3Token2Mel holding both's weights)."""
    if not import_torchaudio():
        pytest.skip(
            "reference missing: pip install --no-deps --target .venv/reference-torchaudio torchaudio==2.11.1"
        )
    program = load_program_class("chatterbox-tiny")(get_spec("chatterbox-tiny"), load_format="dummy")
    program.load_encoders()
    tokenizer, campplus = program._speech_tokenizer, speaker_encoder(seed=2)
    _, ref_tokenizer = reference_encoders(program._speaker_encoder, tokenizer)
    return tokenizer, campplus, reference_embed_ref(ref_tokenizer, campplus)


def reference(ref, wav: np.ndarray) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = ref.embed_ref(torch.from_numpy(wav[:160000]), 16000)
    return {k: out[k][0].numpy() for k in ("prompt_token", "prompt_feat", "embedding")}


def test_a_clips_s3gen_voice_equals_the_reference_embed_ref(encoders):
    tokenizer, campplus, ref = encoders
    clips = {720: clip(720, 0), 32480: clip(32480, 1), 192000: clip(192000, 2)}
    voices = {}
    for n, wav in clips.items():
        got, want = s3gen_voice(wav, tokenizer, campplus), reference(ref, wav)
        voices[n] = got
        p = len(want["prompt_token"])
        assert got["s3gen_tokens"].dtype == np.int32 and got["s3gen_tokens"].shape == (p,)
        assert got["s3gen_mel"].dtype == np.float32 and got["s3gen_mel"].shape == (2 * p, 80)
        assert got["s3gen_xvector"].dtype == np.float32 and got["s3gen_xvector"].shape == (192,)
        np.testing.assert_array_equal(got["s3gen_tokens"], want["prompt_token"])
        mel = want["prompt_feat"]
        assert len(mel) == 2 * p + (n == 32480), "an odd frame only where the clip ends 20-40 ms past a token"
        scale = np.abs(mel).max()  # the log mel: ~4 at its loudest, the floor log(1e-5) = -11.5
        assert np.abs(got["s3gen_mel"] - mel[: 2 * p]).max() <= 1e-4 * scale
        scale = np.abs(want["embedding"]).max()
        assert np.abs(got["s3gen_xvector"] - want["embedding"]).max() <= 1e-4 * scale
    assert [len(v["s3gen_tokens"]) for v in voices.values()] == [1, 50, 250], "25 a second, 10 s at most"
    long, short = voices[192000], voices[32480]
    assert len(set(long["s3gen_tokens"].tolist())) > 4, "the tokens vary"
    assert long["s3gen_mel"].std(0).min() > 0.1, "every band varies"
    x, y = long["s3gen_xvector"], short["s3gen_xvector"]
    assert np.abs(x - y).max() > 100 * 1e-4 * np.abs(x).max(), "the x-vector depends on the clip"


def test_a_clip_too_short_for_a_finite_x_vector_is_refused(encoders):
    tokenizer, campplus, ref = encoders
    wav = clip(MIN_SAMPLES - 20, 3)  # one token, but a single frame after the TDNN's stride
    with pytest.warns(UserWarning, match="degrees of freedom"):
        assert np.isnan(reference(ref, wav)["embedding"]).all(), "the reference's deviation of one frame"
    with pytest.raises(ValueError, match="too short"):
        s3gen_voice(wav, tokenizer, campplus)


def test_the_speaker_encoder_loads_from_s3gens_weights():
    mine = speaker_encoder(seed=5)
    s3gen = {f"speaker_encoder.{k}": v for k, v in mine.state_dict().items()}
    s3gen["flow.input_embedding.weight"] = torch.zeros(3, 2)
    s3gen["tokenizer.encoder.conv1.weight"] = torch.zeros(2)
    loaded = speaker_encoder(s3gen)
    assert not loaded.training and isinstance(loaded, CAMPPlus)
    got = loaded.state_dict()
    for k, v in mine.state_dict().items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(
        speaker_encoder(seed=6).state_dict()["head.conv1.weight"], got["head.conv1.weight"]
    )
    counters = {k for k in s3gen if k.endswith("num_batches_tracked")}
    assert counters and speaker_encoder({k: v for k, v in s3gen.items() if k not in counters}) is not None
    with pytest.raises(KeyError, match="missing"):
        speaker_encoder({k: v for k, v in s3gen.items() if not k.endswith("dense.linear.weight")})
