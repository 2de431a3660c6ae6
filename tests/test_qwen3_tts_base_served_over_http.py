"""qwen3-tts-base-tiny served through every process (gateway → codec_worker's encode service →
tokenizer pool → gpu_worker → codec_worker): a request with a clip (`ref_audio` + `ref_text`)
clones the voice in context, and its audio is, sample for sample, what the engine and the codec
give in this process from the same clip on the same random weights, greedy: the clip's frames
travel as prompt state to the gpu_worker and as the codec stream's prefix with the first window
(tests/test_qwen3_tts_base_clone_parity.py ties that audio to the reference's
`generate_voice_clone`). A voice saved from the clip speaks the same by name and is kept across a
restart; x-vector-only mode needs no transcript and speaks otherwise; what cloning lacks is a 400."""

from __future__ import annotations

import base64
import io
import json
import tempfile

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import torch

from codec_worker.codec import Codec
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gateway.clips import ClipLimits, decode_clip
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import Reference, Voice
from tests.conftest import Server
from tokenizer_worker.worker import wire_array

MODEL = "qwen3-tts-base-tiny"
FRAME = 1920  # samples per 12.5 Hz frame at 24 kHz
TEXT, REF_TEXT = "The sun was low over the harbor.", "A reference."
# Greedy, so the audio depends on nothing but the weights and the prompt; the end id masked long
# enough that a random model speaks a while.
GREEDY = dict(temperature=0, max_tokens=60, min_tokens=20)


def clip_wav(seconds: float = 0.6, seed: int = 5) -> bytes:
    """A voiced-like clip at 24 kHz (the encoders' rate: no resampling), as a float WAV."""
    t = np.arange(int(24000 * seconds)) / 24000
    rng = np.random.default_rng(seed)
    wave = sum(0.2 / k * np.sin(2 * np.pi * 140 * k * t) for k in range(1, 6)) + 0.02 * rng.standard_normal(
        len(t)
    )
    buf = io.BytesIO()
    sf.write(buf, wave.astype(np.float32), 24000, format="WAV", subtype="FLOAT")
    return buf.getvalue()


WAV = clip_wav()
INLINE = "data:audio/wav;base64," + base64.b64encode(WAV).decode()


@pytest.fixture(scope="module")
def voices_dir():
    with tempfile.TemporaryDirectory(prefix="vp-q3-voices-") as d:
        yield d


def serve(voices_dir: str) -> Server:
    return Server("--model", MODEL, "--tokenizer-workers", "1", "--voices-dir", voices_dir)


async def speech(base: str, **body) -> tuple[int, bytes]:
    body = {"model": MODEL, "input": TEXT, "response_format": "pcm", **GREEDY, **body}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json=body) as r:
            return r.status, await r.read()


async def save(base: str, name: str) -> tuple[int, dict]:
    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("ref_text", REF_TEXT)
    form.add_field("audio", WAV, filename="me.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/voices", data=form) as r:
            return r.status, await r.json()


def in_process() -> bytes:
    """The request's PCM16 from this process's program (the workers' random weights), engine and
    codec, from the clip as the gateway decodes it and the codec worker encodes it."""
    spec = get_spec(MODEL)
    program = load_program_class(MODEL)(spec, load_format="dummy")
    program.load_lm()
    program.load_codec()
    program.load_encoders()
    clip = decode_clip(WAV, program.reference_sample_rate, ClipLimits(1 << 24, 60.0))
    (features,) = program.encode_references([Reference(clip.audio, REF_TEXT)])
    built = program.preprocess(TEXT, {"voice": ""}, Voice(features, REF_TEXT))
    rows = np.asarray(built.rows, dtype="<i4")
    defaults = {k: v for k, v in spec["sampling"].items() if k in SamplingParams.__struct_fields__}
    sampling = SamplingParams(**{**defaults, **GREEDY})
    state = {k: wire_array(v) for k, v in built.state.items()}
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    eng.add(Prompt("r", rows.tobytes(), len(rows), sampling, state=state))
    chunks = [c for b in eng.run_until_idle() for c in b.chunks]
    assert chunks[0].prefix, "the clip's frames go with the first window"
    codec = Codec(program, graphs=False, streams=2)
    return b"".join(a.pcm for a in codec.decode(chunks))


async def test_a_clip_and_a_saved_voice_clone_as_the_engine_and_codec_do_here(voices_dir):
    srv = serve(voices_dir)
    try:
        status, by_clip = await speech(srv.base, ref_audio=INLINE, ref_text=REF_TEXT)
        assert status == 200, by_clip
        assert len(by_clip) >= 2 * 20 * FRAME and len(by_clip) % (2 * FRAME) == 0
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each worker runs
        try:
            assert by_clip == in_process(), "served audio equals this process's engine and codec"
        finally:
            torch.set_num_threads(threads)
        status, card = await save(srv.base, "me")
        assert status == 201 and card["name"] == "me" and card["ref_text"] == REF_TEXT, card
        status, by_name = await speech(srv.base, voice="me")
        assert status == 200 and by_name == by_clip, "a saved voice speaks as its clip does"
        status, xvec = await speech(srv.base, ref_audio=INLINE, x_vector_only_mode="true")
        assert status == 200 and len(xvec) % (2 * FRAME) == 0 and xvec[: 2 * FRAME] != by_clip[: 2 * FRAME]
        for body, word in (
            (dict(ref_audio=INLINE), "ref_text"),  # in-context cloning needs the transcript
            ({}, "clip"),  # a Base model clones: no clip, no voice
            (dict(voice="nobody"), "nobody"),
        ):
            status, answer = await speech(srv.base, **body)
            assert status == 400 and word in json.loads(answer)["error"]["message"], (body, answer)
    finally:
        srv.stop()
    srv = serve(voices_dir)  # a restart reads the saved voice back
    try:
        status, again = await speech(srv.base, voice="me")
        assert status == 200 and again == by_clip
    finally:
        srv.stop()
