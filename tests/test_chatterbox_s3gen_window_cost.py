"""What one S3Gen codec window costs (programs/chatterbox/codec.py, docs/models/chatterbox.md "Cost"):

- its flow runs over a fixed 2 (P + flow_context) frames however long its stream is (the prompt and
  the request's last `flow_context` tokens, padded while the request is shorter), so a window's
  FLOPs do not grow with the stream;
- with the published sizes a window is ~3.7 TFLOP, 97% of it the estimator's 10 guided calls
  (batch 2, 800 frames), counted on meta tensors;
- the codec worker decodes Chatterbox's windows in calls of one (`codec_call_batch`), so a lone
  stream's window is not padded to a call of 16 windows."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from codec_worker.codec import Codec
from common.messages import DetokChunk, Finished, FinishReason
from programs import get_spec, load_program_class
from programs.chatterbox import codec as cd

CONFIGS = os.path.join(os.path.dirname(cd.__file__), "configs")
R = 25  # tokens a window (spec: detok_interval)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def window_flops(model: cd.S3Gen, ids: torch.Tensor, key: int) -> list[tuple[int, int, tuple]]:
    """`ids` [B, n] streamed window by window in slots 0..B-1 → per window: its FLOPs, the
    estimator's FLOPs, and the shape of the estimator's input x."""
    b = ids.shape[0]
    est = model.flow.decoder.estimator
    seen: list[tuple] = []
    hook = est.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape)))
    model.init_streams(b + 1)
    out = []
    try:
        for j in range(ids.shape[1] // R):
            fresh = torch.full((b,), j == 0)
            with torch.no_grad(), FlopCounterMode(display=False) as total:
                keys = torch.full((b,), key, dtype=torch.int64, device=ids.device)
                slots = torch.arange(b, device=ids.device)
                model.decode_stream(ids[:, j * R : (j + 1) * R], keys, slots, fresh.to(ids.device))
            counts = total.get_flop_counts()
            name = next(k for k in counts if k.endswith("decoder.estimator"))
            out.append((total.get_total_flops(), sum(counts[name].values()), seen[-1]))
            assert len(set(seen)) == 1, "one estimator shape for every call of a window"
            seen.clear()
    finally:
        hook.remove()
    return out


def test_a_windows_flow_runs_over_a_fixed_context_however_long_its_stream():
    """8 windows of a stream whose tokens outgrow the tiny config's context (40 tokens) twice over:
    every window's estimator sees [2, 80, 2 (P + 40)] and costs the same FLOPs."""
    model = cd.S3Gen.from_config(os.path.join(CONFIGS, "chatterbox-tiny-s3gen.json"), torch.float32, "cpu", 4)
    ids = torch.randint(0, 6561, (1, 8 * R), generator=torch.Generator().manual_seed(1))
    costs = window_flops(model, ids, 3)
    p, ctx = len(model.prompt_tokens), model.flow_context
    assert all(shape == (2, model.mels, 2 * (p + ctx)) for _, _, shape in costs), costs
    assert len({flops for flops, _, _ in costs}) == 1, costs


def test_a_published_size_window_is_3_7_tflop_mostly_the_estimators_guided_steps():
    """The published sizes (chatterbox-s3gen.json: P = 150, flow_context 250) on meta tensors: a
    window is 3.68 TFLOP, the estimator's 10 calls of [2, 80, 800] 3.58 of it."""
    with open(os.path.join(CONFIGS, "chatterbox-s3gen.json")) as f:
        cfg = json.load(f)
    with torch.device("meta"):
        model = cd.S3Gen(cfg).eval()
    one = window_flops(model, torch.zeros(1, R, dtype=torch.int64, device="meta"), 0)[0]
    frames = 2 * (cfg["prompt_tokens"] + cfg["flow_context"])
    assert one[2] == (2, 80, frames) == (2, 80, 800)
    assert 3.6e12 < one[0] < 3.75e12, one
    assert one[1] > 0.95 * one[0], "the estimator's guided steps are the window's cost"


def test_the_codec_worker_decodes_chatterbox_windows_in_calls_of_one():
    """A lone window, and each of three windows arriving together, goes to S3Gen alone; the audio of
    a window decoded among others is its audio alone."""
    program = load_program_class("chatterbox-tiny")(get_spec("chatterbox-tiny"), load_format="dummy")
    program.load_codec()
    calls: list[int] = []
    detokenize = program.detokenize

    def counted(tokens, keys, **kw):
        calls.append(len(tokens))
        return detokenize(tokens, keys, **kw)

    program.detokenize = counted
    codec = Codec(program, max_batch=4, graphs=False, streams=4)
    assert codec.call_batch == 1
    ids = np.random.default_rng(2).integers(0, 6561, size=(3, R, 1)).astype("<i4")
    alone = codec.decode([DetokChunk("a", 0, 5, ids[0].tobytes(), 0)])
    codec.ended([Finished("a", FinishReason.STOP)])
    crowd = codec.decode([DetokChunk(f"c{b}", 0, 5 + b, ids[b].tobytes(), 0) for b in range(3)])
    assert calls == [1, 1, 1, 1], calls
    assert [c.rid for c in crowd] == ["c0", "c1", "c2"]
    assert crowd[0].pcm == alone[0].pcm
    assert np.abs(np.frombuffer(crowd[0].pcm, dtype="<i2")).max() > 0
