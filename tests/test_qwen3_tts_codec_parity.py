"""Qwen3-TTS-Tokenizer-12Hz's decoder (programs/qwen3_tts/codec.py) equals the reference's
`Qwen3TTSTokenizerV2Decoder` (qwen-tts-compat, tokenizer_12hz) for the same random weights and
random codebooks (qwen3-tts-tokenizer-tiny, CPU fp32, sliding window 6 frames): the whole-utterance
decode, and streams decoded a window at a time in slots, interleaved in batches of mixed streams
with padding entries on the scratch slot and slots handed to new streams, match the reference's
decode of each whole stream within 1e-4. Windows decoded without their stream's state do not. In
bfloat16 and float16 (state in that dtype) a stream loses no more than the reference's own decode in
that dtype.
The real config builds the reference's parameters, names and shapes; a checkpoint in the
tokenizer's layout loads. Skips where the reference is missing.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from programs.qwen3_tts import spec as constants
from programs.qwen3_tts.codec import Qwen3TtsCodec
from tests.qwen3_tts_reference import reference_decoder

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "qwen3_tts", "configs")
TINY = os.path.join(CONFIGS, "qwen3-tts-tokenizer-tiny.json")
REAL = os.path.join(CONFIGS, "qwen3-tts-tokenizer-12hz.json")
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair():
    """(codec, reference decoder) with the codec's random weights."""
    codec = Qwen3TtsCodec.from_config(TINY, torch.float32, "cpu", seed=0)
    ref = reference_decoder(TINY)
    ref.load_state_dict(codec.state_dict(), strict=True)
    return codec, ref


def _codes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (n, 16), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _ref_decode(ref, codes: torch.Tensor) -> torch.Tensor:
    """The reference's decode of a whole utterance (`Qwen3TTSTokenizerV2Model.decode`'s path)."""
    return ref.chunked_decode(codes.T[None])[0, 0]


def test_decode_all_equals_the_reference(pair):
    codec, ref = pair
    codes = _codes(20, seed=1)  # 20 frames > the 6-frame sliding window
    expected = _ref_decode(ref, codes)
    got = codec.decode_all(codes)
    assert got.shape == (20 * 1920,)
    assert 0.1 < expected.std() and (expected.abs() >= 1).float().mean() < 0.01  # a signal, unclamped
    assert (got - expected).abs().max() < TOL
    other = _codes(20, seed=2)
    other[:, 1:] = codes[:, 1:]  # one codebook differs: the audio does
    assert (codec.decode_all(other) - expected).abs().max() > 0.05


def _stream(codec, ref, lengths: list[int], sizes: list[int], seed: int) -> None:
    """Streams of `lengths` decoded in windows of a size drawn from `sizes` per call, each call
    batching the streams with that many frames left (in random order) plus a padding entry on the
    scratch slot; 2 slots for the requests, each handed to the next stream as its stream ends."""
    rng = random.Random(seed)
    codes = [_codes(n, seed=100 + i) for i, n in enumerate(lengths)]
    out: list[list[torch.Tensor]] = [[] for _ in lengths]
    done = [0] * len(lengths)
    n_slots = 3
    scratch = n_slots - 1
    codec.init_streams(n_slots)
    active = {0: 0, 1: 1}  # slot → stream
    pending = list(range(2, len(lengths)))
    while active:
        r = rng.choice(sizes)
        entries = [(slot, s) for slot, s in active.items() if lengths[s] - done[s] >= r]
        if not entries:
            r = 1
            entries = list(active.items())
        rng.shuffle(entries)
        batch = [codes[s][done[s] : done[s] + r] for _, s in entries] + [_codes(r, seed=rng.randrange(999))]
        slots = torch.tensor([slot for slot, _ in entries] + [scratch])
        fresh = torch.tensor([done[s] == 0 for _, s in entries] + [rng.random() < 0.5])
        audio = codec.decode_stream(torch.stack(batch), slots, fresh)
        assert audio.shape == (len(entries) + 1, r * 1920)
        for row, (slot, s) in enumerate(entries):
            out[s].append(audio[row])
            done[s] += r
            if done[s] == lengths[s]:
                del active[slot]
                if pending:
                    active[slot] = pending.pop(0)
    for s in range(len(lengths)):
        err = (torch.cat(out[s]) - _ref_decode(ref, codes[s])).abs().max()
        assert err < TOL, f"stream {s}: {err}"


def test_interleaved_streams_in_windows_of_1_to_3_equal_the_whole_decode(pair):
    codec, ref = pair
    _stream(codec, ref, lengths=[17, 11, 13, 9], sizes=[1, 2, 3], seed=0)


def test_interleaved_streams_one_frame_a_call_equal_the_whole_decode(pair):
    codec, ref = pair
    _stream(codec, ref, lengths=[12, 8, 10], sizes=[1], seed=1)


def test_windows_without_their_state_differ(pair):
    """Every window fresh (no past) is not the stream: the state carries what the decode needs."""
    codec, ref = pair
    codes = _codes(12, seed=3)
    expected = _ref_decode(ref, codes)
    codec.init_streams(2)
    slot = torch.tensor([0])
    for fresh_every_window, bound in ((False, TOL), (True, None)):
        out = []
        for i in range(0, 12, 3):
            fresh = torch.tensor([fresh_every_window or i == 0])
            out.append(codec.decode_stream(codes[None, i : i + 3], slot, fresh)[0])
        err = (torch.cat(out) - expected).abs().max()
        if bound is None:
            assert err > 0.05
        else:
            assert err < bound


def test_the_real_config_builds_the_reference_parameters():
    with torch.device("meta"):
        codec = Qwen3TtsCodec(json.load(open(REAL))["decoder_config"])
        ref = reference_decoder(REAL)
    ours = {n: tuple(p.shape) for n, p in codec.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    assert ours == theirs
    assert codec.samples_per_frame == 1920
    assert codec.stateful[0].conv.in_channels == 512  # codebook_dim
    assert sum(p.numel() for p in codec.parameters()) == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("path", [TINY, REAL])
def test_the_configs_decode_the_talkers_frames(path):
    """Both codecs take the talker's 16 codes of 2048 (the tiny talker's too) at 12.5 Hz, 24 kHz."""
    with open(path) as f:
        config = json.load(f)
    cfg = config["decoder_config"]
    assert (cfg["num_quantizers"], cfg["codebook_size"]) == (constants.N_CODEBOOKS, constants.CODE_VOCAB)
    assert config["output_sample_rate"] == constants.SAMPLE_RATE
    assert config["output_sample_rate"] / config["decode_upsample_rate"] == constants.FRAME_RATE
    if path == TINY:
        assert cfg["sliding_window"] < 8  # shorter than every stream these tests decode


def test_a_checkpoint_in_the_tokenizers_layout_loads(tmp_path, pair):
    """model.safetensors with the codec under `decoder.*` beside the encoder's weights."""
    from safetensors.torch import save_file

    codec, _ = pair
    tensors = {f"decoder.{n}": p.detach().clone() for n, p in codec.state_dict().items()}
    tensors["encoder.encoder.layers.0.conv.weight"] = torch.zeros(2, 2, 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(TINY) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    loaded = Qwen3TtsCodec.from_pretrained(str(tmp_path), torch.float32, "cpu")
    codes = _codes(5, seed=4)
    assert torch.equal(loaded.decode_all(codes), codec.decode_all(codes))
    del tensors["decoder.decoder.6.conv.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="decoder.6.conv.bias"):
        Qwen3TtsCodec.from_pretrained(str(tmp_path), torch.float32, "cpu")


def _snr_db(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(10 * torch.log10(want.pow(2).mean() / (got.float() - want).pow(2).mean()))


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, 15.0), (torch.float16, 30.0)])
def test_half_precision_streams_lose_no_more_than_the_reference_in_that_dtype(pair, dtype, bound):
    """The codec in bfloat16 / float16 (state in that dtype): two streams interleaved with a padding
    entry, in windows of 1..3 frames, against the fp32 reference's whole decode. The random network
    amplifies rounding (its SnakeBetas' slopes): the reference's own decode in bfloat16 reaches
    ~18 dB, in float16 ~35 dB; the stream stays within 2 dB of that (half-precision rounding
    differs with the CPU), and above `bound`."""
    base, ref = pair
    codec = Qwen3TtsCodec.from_config(TINY, dtype, "cpu", seed=0)
    codec.init_streams(3)
    assert all(state.dtype == dtype for state in codec.states)
    codes = [_codes(14, seed=10), _codes(14, seed=11)]
    out: list[list[torch.Tensor]] = [[], []]
    done = 0
    for r in (1, 3, 2, 1, 3, 2, 2):
        batch = torch.stack([codes[1][done : done + r], codes[0][done : done + r], _codes(r, seed=done)])
        fresh = torch.tensor([done == 0, done == 0, True])
        audio = codec.decode_stream(batch, torch.tensor([1, 0, 2]), fresh)
        assert audio.dtype == torch.float32
        out[1].append(audio[0])
        out[0].append(audio[1])
        done += r
    ref_half = reference_decoder(TINY)
    ref_half.load_state_dict(base.state_dict(), strict=True)
    ref_half.to(dtype)
    for s in range(2):
        want = _ref_decode(ref, codes[s])
        floor = _snr_db(_ref_decode(ref_half, codes[s]), want)
        snr = _snr_db(torch.cat(out[s]), want)
        assert snr > bound and snr > floor - 2.0, (s, snr, floor)
