"""S3Gen's voiced streams (programs/chatterbox/codec.py; programs/base.py, "Codec streams": voiced
streams), tiny config, random weights, CPU float32: a codec slot set to a cloned voice (prompt
tokens of another length than the default voice's, their mel, an x-vector) decodes a stream exactly
as an S3Gen whose default voice is that voice, whose first window is the reference's decode in that
voice; the default-voice stream beside it in the same batch is unchanged, and a slot set back to
the default voice forgets the cloned one. Through the program: a cloned voice's S3Gen arrays pass
`check_prompt` and reach the codec slot (`codec_voice`, `set_codec_voice`), bad ones are refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from programs import get_spec, load_program_class
from programs.chatterbox import codec as cd
from programs.chatterbox.program import S3GEN_VOICE
from tests.chatterbox_reference import reference_decode, reference_s3gen

CONFIG = os.path.join(os.path.dirname(cd.__file__), "configs", "chatterbox-tiny-s3gen.json")
R = 25  # tokens a window

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def voice(p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random voice: p prompt tokens, their mel [80, 2p] at log-mel levels, an x-vector [192]."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 6561, (p,), generator=g),
        torch.randn(80, 2 * p, generator=g) - 5.0,
        torch.randn(192, generator=g),
    )


@pytest.fixture(scope="module")
def models() -> tuple[cd.S3Gen, cd.S3Gen, tuple[torch.Tensor, ...]]:
    """The default-voice S3Gen, the same weights with the cloned voice as their default, the voice."""
    a = cd.S3Gen.from_config(CONFIG, torch.float32, "cpu", seed=4)
    b = cd.S3Gen.from_config(CONFIG, torch.float32, "cpu", seed=4)
    v = voice(7, 40)  # 7 prompt tokens: the default voice has 10
    b.set_voice(*v)
    return a, b, v


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed))


def windows(model: cd.S3Gen, rows: list[tuple[torch.Tensor, int, int]], n: int) -> list[list[torch.Tensor]]:
    """n windows of each (tokens, key, slot) entry in one batch a window; each entry's audio."""
    out: list[list[torch.Tensor]] = [[] for _ in rows]
    with torch.no_grad():
        for j in range(n):
            batch = torch.stack([t[j * R : (j + 1) * R] for t, _, _ in rows])
            keys = torch.tensor([k for _, k, _ in rows])
            slots = torch.tensor([s for _, _, s in rows])
            audio = model.decode_stream(batch, keys, slots, torch.full((len(rows),), j == 0))
            for i, a in enumerate(audio):
                out[i].append(a)
    return out


def test_a_slot_in_a_cloned_voice_decodes_as_that_voices_s3gen_beside_a_default_one(models):
    a, b, v = models
    x, y = ids(75, 1), ids(75, 2)  # 3 windows: the flow's ring (40 tokens) wraps
    b.init_streams(2)  # batches of two throughout: a CPU GEMM's rounding depends on its rows
    _, cloned = windows(b, [(y, 6, 0), (x, 5, 1)], 3)
    a.init_streams(2)
    plain, _ = windows(a, [(y, 6, 0), (y, 6, 1)], 3)
    a.init_streams(4)
    a.set_stream_voice(2, v)
    mixed = windows(a, [(y, 6, 1), (x, 5, 2)], 3)
    for got, want in zip(mixed[1], cloned, strict=True):
        assert torch.equal(got, want), "the cloned voice's slot decodes as its own S3Gen"
    for got, want in zip(mixed[0], plain, strict=True):
        assert torch.equal(got, want), "the default voice's stream beside it is unchanged"
    default = windows(a, [(y, 6, 0), (x, 5, 1)], 1)[1][0]
    assert (cloned[0] - default).abs().max() > 1e-3, "the voice shapes the audio"


def test_a_cloned_voices_first_window_is_the_references_decode_in_that_voice(models):
    a, b, v = models
    x, key = ids(R, 3), 21
    a.init_streams(3)
    a.set_stream_voice(1, v)
    first = windows(a, [(x, key, 1)], 1)[0][0]
    keys = torch.tensor([key])
    frames = torch.arange(2 * (len(v[0]) + R))[None]
    samples = torch.arange(2 * R * cd.SAMPLES_PER_FRAME)[None]
    noise = {
        "flow": cd.flow_noise(keys, frames, b.mels),
        "phases": cd.source_phases(keys, b.harmonics),
        "source": cd.source_noise(keys, samples, b.harmonics),
    }
    with torch.no_grad():
        want = reference_decode(*reference_s3gen(b), b, x, noise)  # the reference in voice v
        whole = a.decode(x, key, voice=v)
    assert (whole - want).abs().max() < 1e-4, "the whole decode in a given voice is the reference's"
    settled = (2 * R - 3 * a.hift_context) * cd.SAMPLES_PER_FRAME  # HiFT's look-ahead: later frames
    assert (first[:settled] - want[:settled]).abs().max() < 1e-4
    assert want.std() > 0.01


def test_a_slot_set_back_to_the_default_voice_forgets_the_cloned_one(models):
    a, _, v = models
    x = ids(50, 4)
    a.init_streams(2)
    (plain,) = windows(a, [(x, 8, 1)], 2)
    a.set_stream_voice(1, v)
    windows(a, [(ids(50, 5), 9, 1)], 2)
    a.set_stream_voice(1, None)
    (again,) = windows(a, [(x, 8, 1)], 2)
    assert all(torch.equal(p, q) for p, q in zip(plain, again, strict=True))
    with pytest.raises(ValueError, match="voice"):
        a.set_stream_voice(1, voice(a.voice_tokens + 1, 6))


@pytest.fixture(scope="module")
def program():
    p = load_program_class("chatterbox-tiny")(get_spec("chatterbox-tiny"), load_format="dummy", device="cpu")
    p.load_codec()
    p.load_prompts()
    p.init_codec_streams(3)
    return p


def cloned_state(program, p: int = 6) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    tokens, mel, xvector = voice(p, 7)
    prompt = program.preprocess("Hello there.", {})
    state = {
        **prompt.state,
        "s3gen_tokens": tokens.numpy().astype(np.int32),
        "s3gen_mel": mel.T.numpy().astype(np.float32),  # frame-major, as clone.py encodes it
        "s3gen_xvector": xvector.numpy().astype(np.float32),
    }
    return np.asarray(prompt.rows), state


def test_the_program_vets_a_cloned_voices_s3gen_arrays_and_sets_its_codec_slot(program):
    rows, state = cloned_state(program)
    assert program.check_prompt(rows, state) == ""
    voice_arrays = program.codec_voice(state)
    assert sorted(voice_arrays) == sorted(S3GEN_VOICE)
    assert program.codec_voice({k: v for k, v in state.items() if k not in S3GEN_VOICE}) is None
    program.set_codec_voice(1, {k: torch.from_numpy(a) for k, a in voice_arrays.items()})
    s = program.codec
    assert int(s.s_prompt_len[1]) == 6 and torch.equal(
        s.s_prompt[1, :6], torch.from_numpy(state["s3gen_tokens"]).long()
    )
    assert torch.equal(s.s_prompt_mel[1, :, :12], torch.from_numpy(state["s3gen_mel"]).T)
    program.set_codec_voice(1, None)
    assert int(s.s_prompt_len[1]) == len(s.prompt_tokens)
    for bad, why in (
        ({"s3gen_tokens": np.zeros(program.voice_tokens + 1, np.int32)}, "speech tokens"),
        ({"s3gen_tokens": state["s3gen_tokens"] + 7000}, "below"),
        ({"s3gen_mel": state["s3gen_mel"][:-1]}, "s3gen_mel"),
        ({"s3gen_xvector": np.full(192, np.nan, np.float32)}, "finite"),
    ):
        assert why in program.check_prompt(rows, {**state, **bad}), why
    partial = {k: v for k, v in state.items() if k != "s3gen_mel"}
    assert "a cloned voice's" in program.check_prompt(rows, partial)


def test_the_codec_worker_conditions_a_requests_slot_on_the_voice_its_chunk_0_carries(program):
    """Through codec_worker.codec.Codec (eager): chunk 0 of `a` carries a cloned voice
    (`DetokChunk.voice`), `b`'s none, in one batch; a's audio is its stream as an S3Gen whose default
    voice is the cloned one decodes it, b's the default voice's, and a request that takes a's slot
    after it ends speaks in the default voice again. A voice on a later chunk fails its request."""
    from codec_worker.codec import Codec
    from common.arrays import wire_array
    from common.messages import DetokChunk

    _, state = cloned_state(program)
    arrays = {k: wire_array(a) for k, a in program.codec_voice(state).items()}
    x, y = ids(2 * R, 11).numpy(), ids(2 * R, 12).numpy()

    def chunk(rid: str, j: int, codes: np.ndarray, **kw) -> DetokChunk:
        rows = codes[j * R : (j + 1) * R].astype("<i4")
        return DetokChunk(rid, j, 3, rows.tobytes(), j, slack_ms=0 if j == 0 else 1000, **kw)

    def audio(codec: Codec, rid: str, codes: np.ndarray, **kw) -> np.ndarray:
        """rid's two windows of `codes`, alone, chunk 0 with `kw`; its slot released after."""
        out = [codec.decode([chunk(rid, j, codes, **(kw if j == 0 else {}))])[0] for j in range(2)]
        codec.slots.release(rid)
        return np.concatenate([np.frombuffer(a.pcm, "<i2").astype(int) for a in out])

    codec = Codec(program, max_batch=4, graphs=False, streams=2)
    first = codec.decode([chunk("a", 0, x, voice=arrays), chunk("b", 0, y)])
    second = codec.decode([chunk("a", 1, x), chunk("b", 1, y)])
    got = {c.rid: [] for c in first}
    for c in [*first, *second]:
        got[c.rid].append(np.frombuffer(c.pcm, "<i2").astype(int))
    a_audio, b_audio = np.concatenate(got["a"]), np.concatenate(got["b"])
    codec.slots.release("a")
    codec.slots.release("b")
    default_x, default_y = audio(codec, "c", x), audio(codec, "d", y)  # slots a and b held voices
    assert np.abs(b_audio - default_y).max() <= 2, "b: the default voice (a CPU batch of 2 rounds)"
    assert np.abs(a_audio - default_x).max() > 500, "a: another voice"
    cloned = load_program_class("chatterbox-tiny")(
        get_spec("chatterbox-tiny"), load_format="dummy", device="cpu"
    )
    cloned.load_codec()
    v = program.codec_voice(state)
    cloned.codec.set_voice(
        torch.from_numpy(v["s3gen_tokens"]).long(),
        torch.from_numpy(v["s3gen_mel"]).T,
        torch.from_numpy(v["s3gen_xvector"]),
    )
    cloned.init_codec_streams(2)
    want = audio(Codec(cloned, max_batch=4, graphs=False, streams=2), "a", x)
    assert np.abs(a_audio - want).max() <= 2, "a: the cloned voice's S3Gen"
    assert a_audio.std() > 300 and b_audio.std() > 300
    codec.decode([chunk("e", 0, x)])
    late = codec.launch([chunk("e", 1, x, voice=arrays)])
    assert "carries a voice" in late.failed["e"].message


def test_a_voice_longer_than_the_default_takes_context_places_and_decodes_as_the_reference(tmp_path):
    """A config whose voices may bring more prompt tokens than the default voice's (voice_tokens
    20 against 10, as the shipped config's 250 against 150): a 15-token voice leaves the request's
    context 35 of the flow's 50 places, and its first window is still the whole decode of its
    tokens in that voice (HiFT's look-ahead frames aside)."""
    import json

    cfg = {**json.loads(open(CONFIG).read()), "voice_tokens": 20}
    path = tmp_path / "s3gen.json"
    path.write_text(json.dumps(cfg))
    model = cd.S3Gen.from_config(str(path), torch.float32, "cpu", seed=4)
    assert model.positions == 50 and model.window_limit == min(40, 50 - 20) - 2
    v, x, key = voice(15, 41), ids(3 * R, 7), 13
    model.init_streams(2)
    model.set_stream_voice(1, v)
    first = windows(model, [(x, key, 1)], 1)[0][0]
    with torch.no_grad():
        whole = model.decode(x[:R], key, voice=v)
    settled = (2 * R - 3 * model.hift_context) * cd.SAMPLES_PER_FRAME
    assert (first[:settled] - whole[:settled]).abs().max() < 1e-4
    windows(model, [(x, key, 1)], 3)  # the stream's 75 tokens
    _, valid, _, is_token = model._context(torch.tensor([1]), torch.tensor([3 * R]))
    assert int((valid & ~is_token).sum()) == 15 and int(is_token.sum()) == 35
