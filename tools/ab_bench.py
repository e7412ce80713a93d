"""A/B timings of chosen bench cases, on the bench's own inputs and timing (one library per process).

    KDTREE_LIB=build/lib/x/libkdtree_verify.so PYTHONPATH=src python3 tools/ab_bench.py \
        --label x [--suite micro] [--cases NAME,NAME] [--systems ours] [--masks tree] [--layout L] [--json FILE]

Each case is built and timed exactly as `kdtree bench` does it (`gate.run_case`: rotated
input sets, CUDA-graph replay, output checked against the fp32 reference), but only the
named cases and systems run, and nothing is recorded as evidence. It is for comparing
kernel variants side by side in one device call (step `ab-bench` of tools/gpu_session.sh);
`nox -s bench` stays the measurement of record. `--layout` times the cases with another slot
layout than the suite's (e.g. contiguous: what the gather costs against the TMA fast path).
`--sglang-capability 12,0` makes SGLang's extend kernel take the block sizes it takes on a GPU
of that compute capability (its `_get_block_sizes_for_extend_attention` reads the module's
`CUDA_CAPABILITY`: BLOCK_M x BLOCK_N 32 x 32 for the 576-wide MLA query on sm_120, 32 x 64 on
sm_90). It still runs on this GPU, with this GPU's shared memory and occupancy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kdtree_pipeline.bench import gate, suites
from kdtree_pipeline.bench.data import DEFAULT_L2_BYTES
from kdtree_pipeline.bench.peers import PEERS
from kdtree_pipeline.oracle import workloads

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: FlashMLA-from-source peers
import fm_src_peer  # noqa: E402

EXTEND_MODULE = "sglang.kernels.ops.attention.extend_attention"


def parse_capability(text: str) -> tuple[int, int]:
    """'12,0' -> (12, 0); anything else is a ValueError naming the flag and what came."""
    parts = text.split(",")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        raise ValueError(f"--sglang-capability: expected MAJOR,MINOR (e.g. 12,0), got {text!r}")
    return int(parts[0]), int(parts[1])


def set_sglang_capability(cap: tuple[int, int]) -> tuple[int, int] | None:
    """Make SGLang's extend kernel choose its blocks as on a GPU of capability ``cap``;
    returns the capability the module held before (None: it held none)."""
    import importlib

    mod = importlib.import_module(EXTEND_MODULE)
    before = getattr(mod, "CUDA_CAPABILITY", None)
    mod.CUDA_CAPABILITY = tuple(cap)
    return before


def extend_blocks() -> tuple:
    """The block sizes SGLang's extend kernel takes now for the 576-wide MLA query, 512-wide V."""
    import importlib

    return importlib.import_module(EXTEND_MODULE)._get_block_sizes_for_extend_attention(576, 512)


def pick(suite_name: str, cases: str, systems: str, layout: str | None = None, fm_src: Sequence[str] = ()):
    """``--suite``, ``--cases``, ``--systems`` (comma lists) and ``--layout`` -> (suite, its cases by
    name, the names asked for, the systems); a ValueError names the flag and what it does not know.
    ``--fm-src`` specs are registered first (tools/fm_src_peer.py), so --systems may name them.
    tools/clock_probe.py takes its cases, systems and layout through this too."""
    fm_src_peer.register(list(fm_src))
    if layout is not None and layout not in workloads.LAYOUTS:
        raise ValueError(f"--layout: expected one of {', '.join(workloads.LAYOUTS)}, got {layout!r}")
    suite = suites.get_suite(suite_name)
    names = [c for c in cases.split(",") if c]
    known = {c.name: c for c in suite.cases}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--cases: not in suite {suite.name}: {', '.join(unknown)} (have: {', '.join(known)})")
    chosen = tuple(s for s in systems.split(",") if s)
    bad = [s for s in chosen if s not in PEERS]
    if bad:
        raise ValueError(f"--systems: unknown {', '.join(bad)} (have: {', '.join(PEERS)})")
    return suite, known, names, chosen


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
    ap.add_argument("--sglang-capability", default=None, metavar="MAJOR,MINOR",
                    help="SGLang's extend kernel takes the block sizes of this compute capability "
                         "(e.g. 12,0: sm_120's), on this GPU")
    fm_src_peer.add_argument(ap)
    args = ap.parse_args()

    import torch

    try:
        suite, known, names, systems = pick(args.suite, args.cases, args.systems, args.layout, args.fm_src)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    masks = tuple(m for m in args.masks.split(",") if m)
    cap = None
    if args.sglang_capability is not None:
        try:
            cap = parse_capability(args.sglang_capability)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
    if args.alone and args.side_by_side is not None:
        print("--alone and --side-by-side: give one of them", file=sys.stderr)
        return 2
    if args.alone:  # an empty interleaved group: every system timed alone
        args.side_by_side = ""
    together = gate.SIDE_BY_SIDE if args.side_by_side is None else tuple(
        x for x in args.side_by_side.split(",") if x)
    bad = [s for s in together if s not in PEERS]
    if bad:
        print(f"--side-by-side: unknown {', '.join(bad)} (have: {', '.join(PEERS)})", file=sys.stderr)
        return 2
    if cap is not None:
        before = set_sglang_capability(cap)
        print(f"sglang extend: capability {cap} (was {before}); (BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV, BLOCK_M, "
              f"BLOCK_N, num_warps) for MLA: {extend_blocks()}", flush=True)
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
                                        "side_by_side": list(together),
                                        "sglang_capability": list(cap) if cap else None}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
