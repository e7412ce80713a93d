"""Native-target A/B timings that run on this tree and on an older one (CUDA-graph replay, us per call).

    PYTHONPATH=src python3 tools/ab_native.py --label NAME [--shapes bs,N,H,L ...] [--json FILE]

Uses only the API both sides of the C-ABI change share (``workloads.make_batch``,
``Batch.kernel_args``, ``verify_attention(..., out=, max_prefix_len=)``, ``replay_us``),
so the same script times a baseline tree carried in build/old (its own src/ and lib/,
``KDTREE_LIB``) and the code under test on one GPU in one session. Tree masks, random
slot ids. Rounds alternate inside one process only when several ``--env`` settings
are given (e.g. ``--env KDTREE_TMA=0 --env KDTREE_TMA=1``); the bench gate
(`nox -s bench`) stays the measurement of record.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kdtree_engine.kernel.op import verify_attention
from kdtree_pipeline.bench.timing import replay_us
from kdtree_pipeline.oracle import workloads

BATCHED = ("8,16,8,32768", "32,8,16,8192", "64,4,16,4096", "64,4,16,16384", "16,8,128,8192", "4,32,16,32768",
           "1,16,8,65536")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--shapes", nargs="*", default=list(BATCHED), help="bs,N,H,L (default: the batched shapes)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE set before each round (several: rounds)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    settings = args.env or [""]
    for shape in args.shapes:
        bs, n, h, L = (int(x) for x in shape.split(","))
        b = workloads.make_batch([L] * bs, n, h, tree="eagle", seed=1, device="cuda")
        out = torch.empty((b.q.shape[0], h, 512), dtype=torch.bfloat16, device="cuda")
        kargs = b.kernel_args()

        def call(out=out, L=L, kargs=kargs):
            verify_attention(*kargs, out=out, max_prefix_len=L)

        for r in range(args.rounds):
            for s in settings:
                if s:
                    k, v = s.split("=", 1)
                    os.environ[k] = v
                us = replay_us(call)
                label = f"{args.label}{'[' + s + ']' if s else ''}"
                print(f"| {label} | bs{bs}-N{n}-H{h}-L{L} | round {r} | {us:8.1f} |", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps({"label": label, "case": f"bs{bs}-N{n}-H{h}-L{L}", "round": r,
                                            "us": us}) + "\n")
        del b, out, kargs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
