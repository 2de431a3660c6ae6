"""The Higgs Audio v2 codec decodes the LM's delay-pattern rows as streams, one row a call, and the
audio equals the reference tokenizer's whole-utterance decode (transformers'
`HiggsAudioV2TokenizerModel.decode`, same random weights and codebooks) of the rows' frames within
1e-4: utterances shorter and longer than the decoder's lag, one whose second row is all bos again
(the reference starts after the last all-bos row), several streams interleaved in each call with a
stream starting fresh in a slot another one used."""

from __future__ import annotations

import pytest
import torch

from programs import get_spec, load_program_class
from programs.higgs_tts import spec as h
from programs.higgs_tts.codec import HiggsCodec
from tests.higgs_tts_reference import reference_tokenizer


@pytest.fixture(scope="module")
def codec_and_reference():
    p = load_program_class("higgs-tts-tiny")(get_spec("higgs-tts-tiny"), load_format="dummy")
    path = p.config_path("codec_config")
    codec = HiggsCodec.from_config(path, torch.float32, "cpu")
    return codec, reference_tokenizer(codec, path), p.flush_rows


def rows_of(frames: torch.Tensor, flush: int, extra_bos: int = 0) -> torch.Tensor:
    """Frames [T, 8] → the LM's rows: all-bos, codebook k lagging k rows, the forced eos, the
    all-eos row and its flush rows (the stop row is not sent to the codec)."""
    t = len(frames)
    rows = torch.full((extra_bos + t + 8, 8), h.STREAM_BOS)
    for k in range(8):
        rows[extra_bos + k + 1 : extra_bos + k + 1 + t, k] = frames[:, k]
        rows[extra_bos + k + 1 + t :, k] = h.FORCED_EOS
    tail = torch.full((flush, 8), h.FORCED_EOS)
    tail[1:, 0] = h.FLUSH_BASE + torch.arange(1, flush)
    return torch.cat([rows, tail])


def test_streams_equal_the_reference_decode_of_each_whole_utterance(codec_and_reference):
    codec, ref, flush = codec_and_reference
    assert flush == codec.lag_frames == 10
    gen = torch.Generator().manual_seed(5)
    lengths = {"a": (1, 0), "b": (4, 0), "c": (13, 1), "d": (37, 0), "e": (9, 0)}
    frames = {k: torch.randint(0, h.CODES, (t, 8), generator=gen) for k, (t, _) in lengths.items()}
    frames["b"][2, 3] = h.STREAM_EOS  # an eos sampled mid-utterance: the reference clips it to 1023
    rows = {k: rows_of(frames[k], flush, lengths[k][1]) for k in frames}
    codec.init_streams(4)
    slot = {"a": 0, "b": 1, "c": 2, "d": 0, "e": 1}  # d and e take the slots a and b leave
    start = {"a": 0, "b": 2, "c": 5, "d": len(rows["a"]) + 1, "e": len(rows["b"]) + 2}
    audio: dict[str, list[torch.Tensor]] = {k: [] for k in rows}
    for t in range(max(start[k] + len(rows[k]) for k in rows)):
        live = [k for k in rows if 0 <= t - start[k] < len(rows[k])]
        if not live:
            continue
        batch = torch.stack([rows[k][t - start[k]] for k in live])[:, None]  # [Bd, 1, 8]
        out, valid = codec.decode_stream(
            batch, torch.tensor([slot[k] for k in live]), torch.tensor([t == start[k] for k in live])
        )
        for i, k in enumerate(live):
            if valid[i, 0]:
                audio[k].append(out[i])
    for k, f in frames.items():
        with torch.no_grad():
            want = ref.decode(f.clip(0, h.CODES - 1).T[None], return_dict=False)[0, 0]
        got = torch.cat(audio[k])
        assert got.shape == want.shape == (h.SAMPLES_PER_FRAME * len(f),), k
        assert (got - want).abs().max() < 1e-4, k
        assert want.abs().max() > 0.1 and (want.abs() < 1).float().mean() > 0.99, (
            "an audible decode, unclamped"
        )


@pytest.mark.parametrize("window", [2, 3, 8])
def test_windows_of_several_rows_equal_the_reference_decode(codec_and_reference, window):
    """A call of `window` rows a stream (merged codec windows: the decoder runs a call's frames at
    once), two streams taking turns in their slots, one starting with two all-bos rows: each
    utterance's audio equals the reference's whole decode within 1e-4."""
    codec, ref, flush = codec_and_reference
    gen = torch.Generator().manual_seed(11)
    frames = {
        "a": torch.randint(0, h.CODES, (23, 8), generator=gen),
        "b": torch.randint(0, h.CODES, (9, 8), generator=gen),
    }
    rows = {"a": rows_of(frames["a"], flush), "b": rows_of(frames["b"], flush, extra_bos=1)}
    codec.init_streams(3)
    audio: dict[str, list[torch.Tensor]] = {k: [] for k in rows}
    done = dict.fromkeys(rows, 0)
    while any(done[k] < len(rows[k]) for k in rows):
        for slot, k in enumerate(rows):
            lo = done[k]
            if lo >= len(rows[k]):
                continue
            part = rows[k][lo : lo + window][None]  # [1, R, 8]
            out, valid = codec.decode_stream(part, torch.tensor([slot]), torch.tensor([lo == 0]))
            for r, piece in enumerate(out[0].split(h.SAMPLES_PER_FRAME)):
                if valid[0, r]:
                    audio[k].append(piece)
            done[k] = lo + part.shape[1]
    for k, f in frames.items():
        with torch.no_grad():
            want = ref.decode(f.clip(0, h.CODES - 1).T[None], return_dict=False)[0, 0]
        got = torch.cat(audio[k])
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4, k
