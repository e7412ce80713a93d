"""A/B timings of the owned kernel in one configuration (CUDA-graph replay, us per call).

    PYTHONPATH=src python3 tools/sm120_ab.py [--target sm_120] [--label NAME] [--shapes bs,N,H,L ...]

One process times one configuration: the target (``native`` or ``sm_120``) and the
tile that KDTREE_KERNEL / KDTREE_TILE select (both are read once per process), on the
micro suite's shapes (tree masks, random slot ids, bf16 random data) and checks each
output against the fp32 reference. A first look for kernel experiments; the bench gate
(`nox -s bench`) is the measurement of record.

Each case is one input set, replayed with no rotation past the L2, so a kernel that gains
from a warm L2 reads faster here than in the gate: on the same code, bs1 N16 H8 91k read the
sm_120 / Hopper ratio as 2.01-2.02 here and 1.92-1.95 in the gate (docs/kernel-notes.md,
entry M3). For the gate's inputs and timing, A/B with tools/ab_bench.py
(`AB_SYSTEMS=ours,ours-sm120 ... ab-bench`).
"""

from __future__ import annotations

import argparse
import json

import torch

from kdtree_engine.kernel import library
from kdtree_engine.kernel.op import TARGETS, verify_attention
from kdtree_pipeline.bench.suites import MICRO_SHAPES
from kdtree_pipeline.bench.timing import replay_us
from kdtree_pipeline.oracle import compare, reference, workloads


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="native", choices=list(TARGETS))
    ap.add_argument("--label", default=None)
    ap.add_argument("--shapes", nargs="*", default=None, help="bs,N,H,L (default: the micro suite)")
    ap.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else list(MICRO_SHAPES)
    lib = library.load()
    kernel = lib.kernel_name(torch.cuda.current_device(), TARGETS[args.target])
    label = args.label or kernel
    print(f"--- {label}: {kernel} on {torch.cuda.get_device_name()}", flush=True)
    for bs, n, h, L in shapes:
        b = workloads.make_batch([L] * bs, n, h, tree="eagle", seed=1, device="cuda", poison_unused=False)
        out = torch.empty((b.q.shape[0], h, 512), dtype=torch.bfloat16, device="cuda")

        def call(b=b, out=out, L=L):
            verify_attention(*b.kernel_args(), out=out, max_prefix_len=L, target=args.target)

        call()
        torch.cuda.synchronize()
        ok = "-"
        if bs * n * h * L <= 16 * 8 * 65536 * 2:  # the fp32 reference fits comfortably
            ref, _ = reference.verify_attention_ref(*b.ref_args())
            ok = "ok" if compare.compare(out, ref).passed else "WRONG"
        us = replay_us(call)
        print(f"| bs{bs}-N{n}-H{h}-L{L} | {us:8.1f} | {ok} |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"label": label, "kernel": kernel, "case": f"bs{bs}-N{n}-H{h}-L{L}",
                                    "us": us, "check": ok}) + "\n")
        del b, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
