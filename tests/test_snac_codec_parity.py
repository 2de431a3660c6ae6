"""SNAC codec fidelity: `SnacCodec.decode_orpheus_window` equals the unmodified `snac.SNAC.decode`
fed the way the Orpheus reference feeds it (`convert_to_audio`: frames split into three levels,
samples [2048:4096] kept), with the reference's `torch.randn` made to return the noise our keyed
blocks draw, so the noise path is compared too. The default decode is cropped (only what the kept
samples depend on, programs/orpheus/snac_crop.py): it must equal both the reference and our own
full-window decode (`crop=False`). Plus lead windows (1-3 frames, decoded whole), batch
independence, key determinism and the validity flag.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from programs.blocks import rng
from programs.orpheus.codec import SnacCodec
from programs.orpheus.snac_crop import normal_at

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "orpheus", "configs")


def _config(name: str) -> dict:
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


def _random_windows(gen: torch.Generator, n: int) -> torch.Tensor:
    """Valid windows: [n, 28, 1] token ids, code c at row i is 128266 + 4096 * (i % 7) + c."""
    codes = torch.randint(0, 4096, (n, 28), generator=gen)
    return (128266 + 4096 * (torch.arange(28) % 7) + codes)[:, :, None]


def _reference_audio(snac: torch.nn.Module, window: list[int], key: int, monkeypatch) -> torch.Tensor:
    """The reference convert_to_audio on one 28-token window (samples [2048:4096]), its noise
    replaced by ours; a shorter (lead) window: SNAC's decode of its frames, every sample."""
    codes = [t - 128266 - 4096 * (i % 7) for i, t in enumerate(window)]  # turn_token_into_id
    level0, level1, level2 = [], [], []
    for j in range(len(codes) // 7):
        f = codes[7 * j : 7 * j + 7]
        level0.append(f[0])
        level1 += [f[1], f[4]]
        level2 += [f[2], f[3], f[5], f[6]]
    levels = [torch.tensor([lv], dtype=torch.int32) for lv in (level0, level1, level2)]

    calls = []
    real_randn = torch.randn

    def keyed_randn(shape, device=None, dtype=None, **kw):  # SNAC's NoiseBlock: randn((B, 1, T))
        block = len(calls)
        calls.append(shape)
        keys = rng.mix_keys(torch.tensor([key]), block)
        return rng.normal(keys, shape[-1])[:, None, :].to(dtype)

    monkeypatch.setattr(torch, "randn", keyed_randn)
    try:
        with torch.inference_mode():
            audio = snac.decode(levels)
    finally:
        monkeypatch.setattr(torch, "randn", real_randn)
    assert len(calls) == 4, "one noise draw per decoder block"
    return audio[0, 0, 2048:4096] if len(window) == 28 else audio[0, 0]


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, SnacCodec]:
    # Two builds from one seed, not a deepcopy: folding weight norm edits the parametrized class,
    # which a deepcopy shares with its original.
    reference = SnacCodec.dummy_snac(_config("snac-tiny.json"), seed=0)
    return reference, SnacCodec.from_config(_config("snac-tiny.json"), seed=0)


def test_window_decode_equals_reference_snac_with_same_noise(tiny, monkeypatch) -> None:
    reference, codec = tiny
    tokens = _random_windows(torch.Generator().manual_seed(0), 3)
    keys = torch.tensor([11, -5, 2**40], dtype=torch.int64)
    audio, valid = codec.decode_orpheus_window(tokens, keys)
    assert audio.shape == (3, 2048) and audio.dtype == torch.float32
    assert valid.tolist() == [True, True, True]
    for i in range(3):
        want = _reference_audio(reference, tokens[i, :, 0].tolist(), int(keys[i]), monkeypatch)
        torch.testing.assert_close(audio[i], want, atol=1e-5, rtol=0)
    assert audio.abs().max() > 1e-3  # not a trivially silent decoder


def test_batched_windows_equal_each_alone_and_keys_fix_the_noise(tiny) -> None:
    _, codec = tiny
    tokens = _random_windows(torch.Generator().manual_seed(1), 4)
    keys = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    batch, _ = codec.decode_orpheus_window(tokens, keys)
    for i in range(4):
        alone, _ = codec.decode_orpheus_window(tokens[i : i + 1], keys[i : i + 1])
        torch.testing.assert_close(batch[i], alone[0], atol=1e-5, rtol=0)
    same_key, _ = codec.decode_orpheus_window(tokens[:1].expand(2, -1, -1), torch.tensor([7, 7]))
    other_key, _ = codec.decode_orpheus_window(tokens[:1], torch.tensor([8]))
    assert torch.equal(same_key[0], same_key[1])
    assert (same_key[0] - other_key[0]).abs().max() > 1e-4


def test_windows_with_out_of_range_codes_are_flagged_invalid(tiny) -> None:
    _, codec = tiny
    tokens = _random_windows(torch.Generator().manual_seed(2), 5)
    tokens[1, 6, 0] = 128266 + 4096 * 6 + 4096  # code 4096: passes the reference check, crashes SNAC
    tokens[2, 3, 0] = 128266 + 4096 * 3 - 1  # code -1 (a token of the previous slot)
    tokens[3, 0, 0] = 1000  # a text token
    tokens[4, :, 0] = 128266 + 4096 * (torch.arange(28) % 7)  # all codes 0: valid
    audio, valid = codec.decode_orpheus_window(tokens, torch.arange(5))
    assert valid.tolist() == [True, False, False, False, True]
    assert torch.isfinite(audio).all()


def test_real_24khz_architecture_decodes_a_window(monkeypatch) -> None:
    start = time.perf_counter()
    reference = SnacCodec.dummy_snac(_config("snac_24khz.json"), seed=0)
    codec = SnacCodec.from_config(_config("snac_24khz.json"), seed=0)
    tokens = _random_windows(torch.Generator().manual_seed(3), 1)
    audio, valid = codec.decode_orpheus_window(tokens, torch.tensor([42]))
    want = _reference_audio(reference, tokens[0, :, 0].tolist(), 42, monkeypatch)
    torch.testing.assert_close(audio[0], want, atol=1e-5, rtol=0)
    assert bool(valid[0]) and codec.num_noise_blocks == 4
    assert time.perf_counter() - start < 30


def test_noise_drawn_at_an_offset_equals_the_slice_of_the_whole_draw() -> None:
    keys = torch.tensor([0, -3, 2**61], dtype=torch.int64)
    whole = rng.normal(keys, 4096)
    for start, n in [(0, 4096), (0, 7), (1002, 1068), (4090, 6)]:
        assert torch.equal(normal_at(keys, start, n), whole[:, start : start + n])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_cropped_window_equals_the_full_window_decode(tiny, batch) -> None:
    _, codec = tiny
    assert codec.crop
    tokens = _random_windows(torch.Generator().manual_seed(10 + batch), batch)
    keys = torch.randint(-(2**62), 2**62, (batch,), generator=torch.Generator().manual_seed(batch))
    cropped, _ = codec.decode_orpheus_window(tokens, keys)
    full, _ = codec.decode_orpheus_window(tokens, keys, crop=False)
    torch.testing.assert_close(cropped, full, atol=1e-5, rtol=0)
    assert full.abs().max() > 1e-2


def test_real_24khz_cropped_window_equals_full_and_reference(monkeypatch) -> None:
    reference = SnacCodec.dummy_snac(_config("snac_24khz.json"), seed=1)
    codec = SnacCodec.from_config(_config("snac_24khz.json"), seed=1)
    tokens = _random_windows(torch.Generator().manual_seed(4), 3)
    keys = torch.tensor([5, 6, -7])
    cropped, _ = codec.decode_orpheus_window(tokens, keys)
    full, _ = codec.decode_orpheus_window(tokens, keys, crop=False)
    torch.testing.assert_close(cropped, full, atol=1e-5, rtol=0)
    want = _reference_audio(reference, tokens[2, :, 0].tolist(), -7, monkeypatch)
    torch.testing.assert_close(cropped[2], want, atol=1e-5, rtol=0)
    alone, _ = codec.decode_orpheus_window(tokens[1:2], keys[1:2])
    torch.testing.assert_close(alone[0], cropped[1], atol=1e-5, rtol=0)


def test_cropped_decode_does_under_half_the_convolution_work() -> None:
    codec = SnacCodec.from_config(_config("snac_24khz.json"), seed=0)
    full = codec.cropped.macs_by_stage(16, (0, 8192))  # the whole 4-frame window
    cropped = codec.cropped.macs_by_stage(16, (2048, 4096))  # what the kept samples need
    assert list(full) == ["conv in", "block 1", "block 2", "block 3", "block 4", "out"]
    for stage in full:
        assert 0 < cropped[stage] <= full[stage], stage
    assert cropped["block 4"] < 0.3 * full["block 4"]
    assert sum(cropped.values()) < 0.45 * sum(full.values())  # 0.39 measured: 651 M of 1656 M MACs


@pytest.mark.parametrize("rows", [7, 14, 21])
def test_lead_window_equals_reference_snac_decode_of_its_frames(tiny, rows, monkeypatch) -> None:
    reference, codec = tiny
    tokens = _random_windows(torch.Generator().manual_seed(20 + rows), 3)[:, :rows]
    keys = torch.tensor([3, 1 << 40, -9])
    audio, valid = codec.decode_orpheus_window(tokens, keys)
    assert audio.shape == (3, rows // 7 * 2048) and valid.all()
    full, _ = codec.decode_orpheus_window(tokens, keys, crop=False)
    torch.testing.assert_close(audio, full, atol=1e-5, rtol=0)
    for i in range(3):
        want = _reference_audio(reference, tokens[i, :, 0].tolist(), int(keys[i]), monkeypatch)
        torch.testing.assert_close(audio[i], want, atol=1e-5, rtol=0)
    alone, _ = codec.decode_orpheus_window(tokens[2:], keys[2:])
    torch.testing.assert_close(alone[0], audio[2], atol=1e-5, rtol=0)


def test_a_window_of_another_length_is_refused(tiny) -> None:
    _, codec = tiny
    with pytest.raises(ValueError, match="28 rows"):
        codec.decode_orpheus_window(
            _random_windows(torch.Generator().manual_seed(5), 1)[:, :8], torch.tensor([1])
        )
