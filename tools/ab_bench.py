"""A/B timings of chosen bench cases, on the bench's own inputs and timing (one library per process).

    KDTREE_LIB=build/lib/x/libkdtree_verify.so PYTHONPATH=src python3 tools/ab_bench.py \
        --label x [--suite micro] [--cases NAME,NAME] [--systems ours] [--masks tree] [--layout L] [--json FILE]

Each case is built and timed exactly as `kdtree bench` does it (`gate.run_case`: rotated
input sets, CUDA-graph replay, output checked against the fp32 reference), but only the
named cases and systems run, and nothing is recorded as evidence. It is for comparing
kernel variants side by side in one device call (step `ab-bench` of tools/gpu_session.sh);
`nox -s bench` stays the measurement of record. `--layout` times the cases with another slot
layout than the suite's (e.g. contiguous: what the gather costs against the TMA fast path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kdtree_engine.bench import gate, suites
from kdtree_engine.bench.data import DEFAULT_L2_BYTES
from kdtree_engine.bench.peers import PEERS
from kdtree_engine.oracle import workloads


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--suite", default="micro")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all of the suite's)")
    ap.add_argument("--systems", default="ours")
    ap.add_argument("--masks", default="tree",
                    help="comma list: the masks to time (of each case's), in this order; a mask may repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default=None, help=f"slot layout for every case, one of {', '.join(workloads.LAYOUTS)}")
    ap.add_argument("--json", default=None, help="append one row per timing to this JSON-lines file")
    ap.add_argument("--alone", action="store_true",
                    help="time every system alone, one after another (the bench's method before session L), "
                         "instead of the side-by-side systems' replays in interleaved rounds "
                         "(the same as --side-by-side '')")
    ap.add_argument("--side-by-side", default=None, metavar="SYSTEMS",
                    help="comma list: the systems whose replays are timed in interleaved rounds (default: the "
                         "bench's, gate.SIDE_BY_SIDE)")
    args = ap.parse_args()

    import torch

    suite = suites.get_suite(args.suite)
    names = [c for c in args.cases.split(",") if c]
    known = {c.name: c for c in suite.cases}
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"--cases: not in suite {suite.name}: {', '.join(unknown)} (have: {', '.join(known)})", file=sys.stderr)
        return 2
    systems = tuple(s for s in args.systems.split(",") if s)
    bad = [s for s in systems if s not in PEERS]
    if bad:
        print(f"--systems: unknown {', '.join(bad)} (have: {', '.join(PEERS)})", file=sys.stderr)
        return 2
    masks = tuple(m for m in args.masks.split(",") if m)
    if args.layout is not None and args.layout not in workloads.LAYOUTS:
        print(f"--layout: expected one of {', '.join(workloads.LAYOUTS)}, got {args.layout!r}", file=sys.stderr)
        return 2
    if args.alone and args.side_by_side is not None:
        print("--alone and --side-by-side: give one of them", file=sys.stderr)
        return 2
    if args.alone:  # an empty interleaved group: every system timed alone
        args.side_by_side = ""
    together = tuple(x for x in (args.side_by_side or "").split(",") if x)
    bad = [s for s in together if s not in PEERS]
    if bad:
        print(f"--side-by-side: unknown {', '.join(bad)} (have: {', '.join(PEERS)})", file=sys.stderr)
        return 2
    if args.side_by_side is None:
        together = gate.SIDE_BY_SIDE
    peers = {s: PEERS[s] for s in systems}
    missing = {s: why for s in systems if (why := peers[s].check())}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
    for name in names or list(known):
        # in --masks' order, repeats kept (tree,chain,tree: is a figure the mask's or its place's?)
        case = dataclasses.replace(known[name], masks=tuple(m for m in masks if m in known[name].masks),
                                   layout=args.layout or known[name].layout)
        out: list = []
        gate.run_case(case, systems, peers, missing, l2, gate.case_seed(case, args.seed), out, side_by_side=together)
        for r in out:
            us = f"{r.replay_us:8.2f}" if r.replay_us is not None else "     n/a"
            print(f"| {args.label} | {r.case} | {r.system} | {r.mask} | {us} | {r.status} |", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"label": args.label, "case": r.case, "system": r.system, "mask": r.mask,
                                        "layout": case.layout, "us": r.replay_us, "status": r.status,
                                        "side_by_side": list(together)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
