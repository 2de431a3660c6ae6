"""CSM's voice cloning equals transformers' CsmForConditionalGeneration given the same clip as an
audio turn (csm-tiny, the same random weights, CPU fp32): a 16 kHz WAV decoded and resampled by the
gateway (gateway.clips), encoded by the program's Mimi encoder into the codes transformers' codec
encodes, built into the prompt of the reference's template (`[speaker]ref_text`, the clip's frames,
the end frame, then the turn to speak), and the greedy frames served from it equal transformers'
generation from its own merge of the clip."""

# ruff: noqa: F811 (the fixtures come from tests/test_csm_parity.py; tests take them by name)

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from gateway.clips import ClipLimits, decode_clip
from programs.base import Reference, Voice
from programs.csm.spec import EOS_ID, TEXT_MARK
from tests.test_csm_parity import AUDIO, AUDIO_EOS, hf, make_prompt, program, run  # noqa: F401

LIMITS = ClipLimits(1 << 20, 30.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def wav_bytes(rate: int, seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * rng.standard_normal(len(t)))
    buf = io.BytesIO()
    sf.write(buf, np.clip(wave, -1, 1).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoders(program):
    program.load_encoders()  # the encoder takes the loaded codec's weights (transformers' here)
    return program


def test_clips_encode_to_transformers_codes_alone_and_batched(hf, encoders):
    clips = [
        decode_clip(wav_bytes(rate, s, i), 24000, LIMITS)
        for i, (rate, s) in enumerate([(16000, 0.5), (24000, 0.33), (44100, 0.21)])
    ]
    got = encoders.encode_references([Reference(c.audio) for c in clips])
    for c, features in zip(clips, got, strict=True):
        with torch.no_grad():
            want = hf.codec_model.encode(torch.from_numpy(c.audio)[None, None]).audio_codes[0].T.numpy()
        assert features["codes"].dtype == np.int32
        np.testing.assert_array_equal(features["codes"], want)
        np.testing.assert_array_equal(encoders.encode_references([Reference(c.audio)])[0]["codes"], want)
    assert len({len(f["codes"]) for f in got}) == 3, "three lengths in one padded batch"


def test_a_cloned_voice_speaks_the_greedy_frames_transformers_speaks_from_the_clip(hf, encoders):
    clip = decode_clip(wav_bytes(16000, 0.45, 7), 24000, LIMITS)  # resampled to Mimi's 24 kHz
    [features] = encoders.encode_references([Reference(clip.audio, "Ref.")])
    voice = Voice(features, "Ref.")
    rows = encoders.preprocess("Hello.", {"voice": "2"}, voice=voice)
    plain = encoders.preprocess("Hello.", {"voice": "2"})
    n = len(features["codes"])
    assert encoders.option_rows({"voice": "2"}, voice) == len(rows) - len(plain)
    # The prompt: the voice's turn in the request's speaker, its frames, the end frame, the text turn.
    turn = encoders.preprocess("Ref.", {"voice": "2"})
    assert rows[: len(turn)].tolist() == turn.tolist()
    assert rows[len(turn) : len(turn) + n].tolist() == features["codes"].tolist()
    assert rows[len(turn) + n].tolist() == [0] * 32
    assert rows[len(turn) + n + 1 :].tolist() == plain.tolist()
    # transformers: the same ids with the clip's audio placeholders, merged from the raw audio.
    ids = [int(r[0]) for r in turn] + [AUDIO] * n + [AUDIO_EOS] + [int(r[0]) for r in plain]
    assert all(r[1] == TEXT_MARK for r in turn) and turn[-1][0] == EOS_ID
    wave = torch.from_numpy(clip.audio)[None, None]
    with torch.no_grad():
        merged = hf._merge_input_ids_with_input_values(
            torch.tensor([ids]), wave, torch.tensor([[wave.shape[-1]]])
        )
        want = hf.generate(
            inputs_embeds=merged["inputs_embeds"],
            max_new_tokens=6,
            do_sample=False,
            depth_decoder_do_sample=False,
        )[0].numpy()
    eng = run(encoders, [make_prompt("clone", rows.tolist(), 6, temperature=0.0)])
    got = np.array(eng.outputs["clone"][0])
    np.testing.assert_array_equal(got, want)
    other = run(encoders, [make_prompt("plain", plain.tolist(), 6, temperature=0.0)])
    assert not np.array_equal(np.array(other.outputs["plain"][0]), got), "the clip changes the frames"
