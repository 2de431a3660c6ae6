"""GPU: greedy tokens of one request alone vs among 3, 17, 40 and 160 others (graphs on, the
serving defaults; then without mixed prefill+decode graphs), the check of `bench/gpu_parity.py`
section 3 on its own (a minute instead of several); with `--temperatures`, the same for requests
that sample (each with its own seed: a draw must not depend on the batch either).

    python -m bench.batch_invariance --out batch_invariance.json [--kv-cache-dtypes auto,fp8]
        [--temperatures 0,0.6] [--quantization fp8 --lm-head audio]

`--quantization fp8 --lm-head audio --kv-cache-dtypes fp8` is the configuration the load benchmark
serves: its GEMMs give one row the same bits at any batch (bench/op_invariance.py), the bf16 ones
do not beyond a few dozen rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.gpu_parity import greedy_batches, greedy_setup
from programs import get_spec, load_program_class


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="batch_invariance.json")
    ap.add_argument("--lm-head", default="full")
    ap.add_argument("--quantization", default="none", choices=("none", "fp8"))
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma list: each is checked")
    ap.add_argument(
        "--temperatures", default="0", help="comma list: 0 is greedy; others sample (mixed graphs on)"
    )
    args = ap.parse_args()
    p = load_program_class("orpheus")(get_spec("orpheus"), load_format="dummy", device="cuda",
                                      dtype=torch.bfloat16, lm_head=args.lm_head,
                                      quantization=args.quantization)  # fmt: skip
    p.load_lm()
    prompt, engine = greedy_setup(p)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%F"), "lm_head": args.lm_head,
           "quantization": args.quantization}  # fmt: skip
    res["greedy_alone_vs_batched"] = {}
    for kv in args.kv_cache_dtypes.split(","):
        for mixed in (True, False):  # a new prompt in one graph with the decode rows, or apart
            name = kv if mixed else f"{kv}, no mixed graphs"
            kw = {"kv_cache_dtype": kv, "mixed_prefill": mixed}
            res["greedy_alone_vs_batched"][name] = greedy_batches(engine, prompt, kw)
            print(name, res["greedy_alone_vs_batched"][name], flush=True)
        for t in (float(x) for x in args.temperatures.split(",") if float(x) > 0):
            name = f"{kv}, sampled at temperature {t:g}"
            kw = {"kv_cache_dtype": kv, "mixed_prefill": True}
            res["greedy_alone_vs_batched"][name] = greedy_batches(engine, prompt, kw, t)
            print(name, res["greedy_alone_vs_batched"][name], flush=True)
    res["ok"] = all(
        v["first_difference"] is None for per in res["greedy_alone_vs_batched"].values() for v in per.values()
    )
    print(json.dumps(res), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
