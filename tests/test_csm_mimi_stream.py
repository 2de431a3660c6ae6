"""Mimi's stream decoder (programs/csm/mimi_stream.py) gives each stream the audio of transformers'
`MimiModel.decode` over the whole stream, within 1e-4 (CPU fp32, random weights and codebooks):
streams interleaved in shared batches with windows of random sizes or one frame each, slots reused
by new streams, padding entries on the scratch slot, CSM's extra ids decoded as code 2047; every
piece of carried state changes the audio; the real kyutai/mimi shape too.

csm-tiny's Mimi attends over 8 transformer steps (4 frames), so streams of 9..24 frames wrap each
slot's key/value ring several times."""

from __future__ import annotations

import json
import os

import pytest
import torch

from programs.csm.codec import MimiCodec

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "programs", "csm", "configs")
TOL = 1e-4
N_SLOTS = 4  # the last is the scratch slot that padding entries use


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> MimiCodec:
    """csm-tiny's Mimi with a transformer that counts: transformers' init scales its residual
    branches by 0.01 and draws its Linear weights at std 0.02 (near-uniform attention), so what
    the transformer attends to would move the audio by less than the tolerance. Full layer scales
    and std 0.3 make its keys, values and positions show in the audio."""
    with open(os.path.join(CONFIGS, "mimi-tiny.json")) as f:
        cfg = json.load(f)
    assert cfg["sliding_window"] == 8
    path = tmp_path_factory.mktemp("mimi") / "mimi-tiny-strong.json"
    path.write_text(json.dumps({**cfg, "layer_scale_initial_scale": 1.0, "initializer_range": 0.3}))
    return MimiCodec.from_config(str(path), 4, torch.float32, "cpu")


def _streams(n: int, gen: torch.Generator, lengths: tuple[int, int]) -> list[torch.Tensor]:
    """n streams of [T, 32] codes, T in lengths; ~3 % of them CSM's extra ids 2048..2050."""
    out = []
    for _ in range(n):
        t = int(torch.randint(*lengths, (1,), generator=gen))
        frames = torch.randint(0, 2048, (t, 32), generator=gen)
        extra = torch.rand(t, 32, generator=gen) < 0.03
        out.append(torch.where(extra, torch.randint(2048, 2051, (t, 32), generator=gen), frames))
    return out


def _decode_interleaved(codec: MimiCodec, streams, sizes, gen: torch.Generator) -> list[torch.Tensor]:
    """Decode every stream through N_SLOTS - 1 slots, in batches of a random subset of the active
    streams (random order, plus scratch-slot padding) of R frames, R drawn from `sizes`. A stream
    ends inside its last window (its tail frames are filler) and a queued one takes its slot."""
    codec.init_streams(N_SLOTS)
    spf = codec.samples_per_frame
    queue = list(range(len(streams)))
    active: dict[int, tuple[int, int]] = {}  # slot -> (stream, frames decoded)
    audio: list[list[torch.Tensor]] = [[] for _ in streams]
    while queue or active:
        for slot in range(N_SLOTS - 1):
            if slot not in active and queue:
                active[slot] = (queue.pop(0), 0)
        r = sizes[int(torch.randint(len(sizes), (1,), generator=gen))]
        chosen = [s for s in active if torch.rand(1, generator=gen) < 0.7] or list(active)
        chosen = [chosen[i] for i in torch.randperm(len(chosen), generator=gen)]
        codes = torch.randint(0, 2051, (len(chosen) + 1, r, 32), generator=gen)  # last: padding
        for b, slot in enumerate(chosen):
            i, done = active[slot]
            rows = streams[i][done : done + r]
            codes[b, : len(rows)] = rows
        slots = torch.tensor([*chosen, N_SLOTS - 1])
        fresh = torch.tensor([active[s][1] == 0 for s in chosen] + [bool(torch.rand(1, generator=gen) < 0.5)])
        out = codec.decode_stream(codes, slots, fresh)
        assert out.shape == (len(chosen) + 1, r * spf)
        for b, slot in enumerate(chosen):
            i, done = active[slot]
            n = min(r, len(streams[i]) - done)
            audio[i].append(out[b, : n * spf])
            if done + n == len(streams[i]):
                del active[slot]
            else:
                active[slot] = (i, done + n)
    return [torch.cat(a) for a in audio]


def _reference(codec: MimiCodec, frames: torch.Tensor) -> torch.Tensor:
    return codec.decode_all(frames.clamp(max=codec.codebook_size - 1))


@pytest.mark.parametrize(
    "sizes",
    [(1, 2, 3), (1,), (4, 5)],
    ids=["random_windows", "one_frame_windows", "windows_past_the_ring"],  # 10 steps > 8
)
def test_interleaved_streams_equal_the_whole_stream_decode(tiny: MimiCodec, sizes):
    gen = torch.Generator().manual_seed(len(sizes))
    streams = _streams(7, gen, (9, 25))  # 7 streams over 3 slots: every slot serves 2 or 3
    for frames, got in zip(streams, _decode_interleaved(tiny, streams, sizes, gen), strict=True):
        want = _reference(tiny, frames)
        assert got.shape == want.shape
        assert (got - want).abs().max() < TOL


def test_every_piece_of_state_is_carried(tiny: MimiCodec):
    """Zeroing any one state buffer of a slot between two windows moves the second window's audio
    far off the reference: the ring's keys, its values, the step count (RoPE and ring positions), each
    causal conv's history, each transposed conv's pending overlap."""
    gen = torch.Generator().manual_seed(7)
    frames = torch.randint(0, 2048, (12, 32), generator=gen)
    want = _reference(tiny, frames)[9 * 1920 :]
    slot, fresh, keep = torch.tensor([0]), torch.tensor([True]), torch.tensor([False])
    tiny.init_streams(2)
    streams = tiny.streams
    pieces = [("keys", streams.keys[:, 0]), ("values", streams.values[:, 0]), ("steps", streams.steps[0])]
    pieces += [(type(conv).__name__, buf[0]) for conv, buf in streams.state.items()]
    assert len(pieces) == 3 + 11  # upsample; SEANet: 2 causal convs, 4 transposed, 4 residual (k 3)
    for name, buf in [("none", None), *pieces]:
        tiny.decode_stream(frames[None, :9], slot, fresh)
        if buf is not None:
            buf.zero_()
        err = (tiny.decode_stream(frames[None, 9:], slot, keep)[0] - want).abs().max()
        assert (err < TOL) if buf is None else (err > 100 * TOL), (name, float(err))


def test_real_mimi_shape_equals_the_whole_stream_decode():
    """kyutai/mimi's shape (8 layers of 512, 250-step window, 256-dim codebooks): two streams of 60
    frames sharing batches of random window sizes."""
    codec = MimiCodec.from_config(os.path.join(CONFIGS, "mimi.json"), 4, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    streams = _streams(2, gen, (60, 61))
    for frames, got in zip(streams, _decode_interleaved(codec, streams, (1, 2, 3), gen), strict=True):
        assert (got - _reference(codec, frames)).abs().max() < TOL


def test_a_step_sees_only_the_sliding_window(tiny: MimiCodec):
    """The 8-step window shapes the reference's audio: the same decoder over a 64-step ring (every
    step of the stream in view) misses it, past the first 4 frames alone."""
    from programs.csm.mimi_stream import MimiStreamDecoder

    frames = torch.randint(0, 2048, (24, 32), generator=torch.Generator().manual_seed(5))
    want = _reference(tiny, frames)
    wide = MimiStreamDecoder(tiny.model)
    wide.window = 64
    wide.init_streams(1)
    got = wide.decode_stream(frames[None], torch.tensor([0]), torch.tensor([True]))[0]
    err = (got - want).abs()
    assert err[: 4 * 1920].max() < TOL
    assert err[4 * 1920 :].max() > 100 * TOL
