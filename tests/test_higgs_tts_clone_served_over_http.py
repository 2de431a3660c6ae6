"""higgs-tts-tiny served through every process (gateway → codec_worker's encode service → tokenizer
pool → gpu_worker → codec_worker): a request with a clip (`ref_audio` + `ref_text`) clones the voice,
and its audio is, sample for sample, what the engine and the codec give in this process from the
same clip on the same random weights, greedy (tests/test_higgs_tts_clone_prompt.py ties the rows to
the reference's `generate` given the clip). A voice saved from the clip speaks the same by name; a
clip without its transcript is a 400 that says so."""

from __future__ import annotations

import json
import tempfile

import aiohttp
import numpy as np
import pytest
import torch

from codec_worker.codec import Codec
from common.config import GpuWorkerSettings
from common.messages import Prompt, SamplingParams
from gateway.clips import ClipLimits, decode_clip
from gpu_worker.engine import Engine
from programs import get_spec, load_program_class
from programs.base import Reference, Voice
from tests.conftest import Server
from tests.test_qwen3_tts_base_served_over_http import INLINE, REF_TEXT, TEXT, WAV
from tests.test_qwen3_tts_base_served_over_http import save as save_voice

MODEL = "higgs-tts-tiny"
FRAME = 960  # samples per 25 Hz frame at 24 kHz
# Greedy, so the audio depends on nothing but the weights and the prompt; random weights never end
# an utterance, so the request runs to max_tokens (its prompt's rows included).
GREEDY = dict(temperature=0, max_tokens=260, min_tokens=0)


@pytest.fixture(scope="module")
def voices_dir():
    with tempfile.TemporaryDirectory(prefix="vp-higgs-voices-") as d:
        yield d


async def speech(base: str, **body) -> tuple[int, bytes]:
    body = {"model": MODEL, "input": TEXT, "response_format": "pcm", **GREEDY, **body}
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/audio/speech", json=body) as r:
            return r.status, await r.read()


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
    rows = np.asarray(program.preprocess(TEXT, {"voice": ""}, Voice(features, REF_TEXT)).rows, "<i4")
    defaults = {k: v for k, v in spec["sampling"].items() if k in SamplingParams.__struct_fields__}
    eng = Engine(program, GpuWorkerSettings(max_batch_size=4, max_context=400))
    eng.add(Prompt("r", rows.tobytes(), len(rows), SamplingParams(**{**defaults, **GREEDY})))
    chunks = [c for b in eng.run_until_idle() for c in b.chunks]
    assert not chunks[0].prefix, "the stream starts fresh: the reference decodes only generated rows"
    codec = Codec(program, graphs=False, streams=2)
    return b"".join(a.pcm for a in codec.decode(chunks))


async def test_a_clip_and_a_saved_voice_clone_as_the_engine_and_codec_do_here(voices_dir):
    srv = Server("--model", MODEL, "--tokenizer-workers", "1", "--voices-dir", voices_dir)
    try:
        status, by_clip = await speech(srv.base, ref_audio=INLINE, ref_text=REF_TEXT)
        assert status == 200, by_clip
        assert len(by_clip) >= 2 * 40 * FRAME and len(by_clip) % (2 * FRAME) == 0
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each worker runs
        try:
            assert by_clip == in_process(), "served audio equals this process's engine and codec"
        finally:
            torch.set_num_threads(threads)
        _, plain = await speech(srv.base, input=TEXT)
        assert plain[: 2 * 40 * FRAME] != by_clip[: 2 * 40 * FRAME], "the clip is in the prompt"
        status, card = await save_voice(srv.base, "me")
        assert status == 201 and card["name"] == "me" and card["ref_text"] == REF_TEXT, card
        status, by_name = await speech(srv.base, voice="me")
        assert status == 200 and by_name == by_clip, "a saved voice speaks as its clip does"
        status, answer = await speech(srv.base, ref_audio=INLINE)
        assert status == 400 and "ref_text" in json.loads(answer)["error"]["message"], answer
    finally:
        srv.stop()
