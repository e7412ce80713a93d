"""Ragged batches: the owned kernel against FlashMLA when a batch's prefixes differ.

Session V wrote it when the micro suite gave every request of a case the same prefix and ours
capped each request at the grid's split count (csrc/common.cuh split_plan), which left the GPU
idle behind one long request. Since session W both kernels run the batch schedule (batch_plan:
one wave of CTAs shared by the requests by their work), and since session X the micro suite times
these batches itself with every peer (`Case.ragged`, suites.RAGGED_CASES), which is the record.
This probe stays a quick A/B: 20 calls on the same inputs per replayed graph, ours with and without
the host hint beside FlashMLA (docs/kernel-notes.md V6, W1, X1, X5).

    python3 tools/ragged_probe.py [--rounds 3] [--json FILE]

Each case is a chain batch (FlashMLA runs chains only) from the oracle's workload builder,
random slots, timed under CUDA-graph replay (bench.timing.replay_us), ours (with the host's
prefix hint, as the bench calls it, and without it, as the plugin calls it under capture) and
FlashMLA alternating for --rounds rounds; both outputs are checked against the fp32 reference
first. The inputs are not rotated: the larger cases exceed the 60 MB L2, the smaller do not
(the table prints each case's bytes).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

#: (name, prefix lengths, drafts per request, heads); the uniform case is the micro suite's
#: bs8 shape, a control for the harness
CASES = (
    ("bs8-N16-H8-uniform32k", [32768] * 8, 16, 8),
    ("bs8-N16-H8-one64k-seven1k", [65536] + [1024] * 7, 16, 8),
    ("bs8-N16-H8-geometric32k", [32768 >> i for i in range(8)], 16, 8),
    ("bs4-N16-H8-one91k-three4k", [91000, 4096, 4096, 4096], 16, 8),
    ("bs32-N8-H16-one32k-rest2k", [32768] + [2048] * 31, 8, 16),
    ("bs16-N16-H8-two64k-rest1k", [65536, 65536] + [1024] * 14, 16, 8),
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="append one row per timing to this JSON-lines file")
    ap.add_argument("--cases", default="", help="comma list of case names (default: all)")
    args = ap.parse_args()

    import torch

    from kdtree_pipeline.bench import timing
    from kdtree_pipeline.bench.peers import PEERS
    from kdtree_pipeline.oracle import compare, reference, workloads

    if not torch.cuda.is_available():
        print("ragged_probe: needs a CUDA GPU", file=sys.stderr)
        return 1
    names = [c[0] for c in CASES]
    want = [c for c in args.cases.split(",") if c]
    unknown = [c for c in want if c not in names]
    if unknown:
        print(f"--cases: unknown {', '.join(unknown)} (have: {', '.join(names)})", file=sys.stderr)
        return 2
    rows = []
    print("| case | prefixes | MB | ours | ours, no hint | FlashMLA | ours / FlashMLA | no hint / FlashMLA |")
    print("|---|---|---|---|---|---|---|---|")
    for name, lens, n, h in CASES:
        if want and name not in want:
            continue
        b = workloads.make_batch(lens, n, h, tree="chain", layout="fragmented", seed=5, device="cuda")
        ref, _ = reference.verify_attention_ref(*b.ref_args())
        nohint = dataclasses.replace(b, meta={**b.meta, "hint": False})  # the same tensors, no host hint
        runs = {"ours": PEERS["ours"].prepare(b), "ours-nohint": PEERS["ours"].prepare(nohint),
                "flashmla": PEERS["flashmla"].prepare(b)}
        for sysname, fn in runs.items():
            out = fn().reshape(ref.shape)
            d = compare.compare(out, ref)
            if not d.passed:
                print(f"ragged_probe: {name}: {sysname} output does not match the reference: {d}", file=sys.stderr)
                return 1
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for sysname, fn in runs.items():
                times[sysname].append(timing.replay_us(fn))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        mb = sum(lens) * 1152 / 1e6
        desc = ", ".join(f"{v} x {k}" for k, v in sorted(collections.Counter(lens).items(), reverse=True))
        print(f"| {name} | {desc} | {mb:.0f} | {med['ours']:.1f} | {med['ours-nohint']:.1f} | {med['flashmla']:.1f} | "
              f"{med['ours'] / med['flashmla']:.2f} | {med['ours-nohint'] / med['flashmla']:.2f} |", flush=True)
        for sysname, v in times.items():
            rows.append({"case": name, "prefix_lens": lens, "n": n, "heads": h, "system": sysname, "us": v})
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
