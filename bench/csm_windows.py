"""How far CSM's streamed Mimi windows are from `MimiModel.decode` of the whole stream.

The runtime decodes windows of detok_interval frames that keep their last stride frames (see
programs/csm/codec.py), with pad frames before the first and after the last. Mimi is causal, so the
only difference from the whole-stream decode is context older than a window's first frame. This
script measures it for any weights: random ones from a shipped config (the default), or a checkpoint
(`--codec-weights sesame/csm-1b`, `kyutai/mimi` or a local directory), on random codes or on codes of
real speech (`--codes frames.npy`, [T, 32] int).

    voxpipe bench csm-windows --model csm [--codec-weights DIR] [--codes frames.npy] [--device cuda]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from programs import get_spec, load_program_class


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="csm", help="csm (kyutai/mimi shape) or csm-tiny")
    ap.add_argument("--codec-weights", default="", help="checkpoint; default: random weights")
    ap.add_argument("--codes", default="", help=".npy of [T, 32] Mimi codes; default: random")
    ap.add_argument("--frames", type=int, default=100, help="random codes: stream length in frames")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    spec = get_spec(args.model)
    load_format = "auto" if args.codec_weights else "dummy"
    p = load_program_class(args.model)(
        spec, load_format=load_format, device=args.device, codec_weights=args.codec_weights or None
    )
    p.load_codec()
    if args.codes:
        frames = torch.from_numpy(np.load(args.codes)).long()
    else:
        frames = torch.randint(0, 2048, (args.frames, 32), generator=torch.Generator().manual_seed(0))
    frames = frames.to(args.device)
    n, interval, stride = len(frames), p.detok_interval, p.detok_interval - p.detok_overlap
    rows = torch.cat([torch.from_numpy(p.preseed_rows()).long().to(args.device), frames])
    total = len(rows)
    last = -(-(total - interval) // stride)  # windows 0..last, the last one padded past the end
    pad = torch.from_numpy(p.pad_rows(last * stride + interval - total)).long().to(args.device)
    rows = torch.cat([rows, pad])
    # As the runtime sends them: window j is rows [window_start(j), j*s + interval), no preseed rows.
    windows = [rows[p.window_start(j) : j * stride + interval][None] for j in range(last + 1)]
    key = torch.zeros(1, dtype=torch.long, device=args.device)
    with torch.no_grad():
        decoded = [p.detokenize(w, key) for w in windows]
        whole = p.codec.decode_all(frames)
    audio = torch.cat([a for a, _ in decoded], dim=1)
    valid = torch.cat([v for _, v in decoded])
    streamed = audio.reshape(-1)[: len(whole)]
    per_frame = (streamed - whole).abs().reshape(n, -1).amax(dim=1).cpu()  # [T]
    res = {
        "model": args.model,
        "weights": args.codec_weights or "random",
        "frames": n,
        "window_frames": interval,
        "context_frames": p.detok_overlap,
        "all_valid": bool(valid.all()),
        "max_abs_diff": float(per_frame.max()),
        "max_abs_diff_first_window": float(per_frame[:stride].max()),
        "whole_abs_max": float(whole.abs().max()),
        "frames_over_1e-4": int((per_frame > 1e-4).sum()),
        "snr_db": round(float(10 * torch.log10((whole**2).sum() / ((streamed - whole) ** 2).sum())), 1),
    }
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
