"""What bf16 split-KV partials would cost in accuracy: a CPU simulation of the kernels' rounding
(not the kernels), scored by the oracle's own metric (kdtree_pipeline.oracle.compare).

One request of N drafts over a prefix of L keys, H heads: the oracle's own data
(workloads.make_batch: a draft tree, random slots, its score scale) and its float64 reference
(reference.verify_attention_ref). Each split of a grid of S (contiguous runs of whole 32-key
tiles, as split_plan cuts them: at most ceil((L + N) / 128) splits) takes fp32 scores, P
rounded to bf16 before P.V (as both kernels do), fp32 sums and a normalised partial; the
splits merge by their LSEs as the combine does, and the output is rounded to
bf16. The partials go to the merge in fp32 (what the kernels stored before entry S1) or rounded
to bf16 (what they store since, as FlashInfer's split-KV decode does).

    python3 tools/partials_precision.py                # the default grid
    python3 tools/partials_precision.py --cases 1,16,8,23000,66 --seeds 3
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kdtree_engine.kernel import op  # noqa: E402
from kdtree_pipeline.oracle import compare, reference, workloads  # noqa: E402

D, DV, TILE = 576, 512, 32
DEFAULT_CASES = ((16, 8, 1024, 9), (16, 8, 4096, 33), (16, 8, 23000, 66), (16, 8, 65536, 66), (64, 8, 23000, 16),
                 (16, 64, 8192, 8), (8, 16, 8192, 2))


def split_bounds(keys: int, splits: int) -> list[tuple[int, int]]:
    """[lo, hi) of each split of a request of ``keys`` keys under a grid of ``splits``, cut in
    TILE-key steps as the device cuts them (op.split_plan: at most ceil(keys / 128) splits)."""
    n, per = op.split_plan(keys, splits, TILE)
    return [(s * per * TILE, min(keys, (s + 1) * per * TILE)) for s in range(n)]


def simulate(n: int, heads: int, prefix: int, splits: int, seed: int) -> dict[str, compare.Diff]:
    b = workloads.make_batch([prefix], [n], heads, seed=seed)  # the oracle's data: a draft tree, random slots
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    k = torch.cat([b.kv_buffer[b.kv_indices, 0], b.k_ext[:, 0]])  # the request's keys, prefix then drafts
    q = b.q.reshape(n * heads, D)  # row = token * H + head
    visible = b.custom_mask.reshape(n, prefix + n).bool().repeat_interleave(heads, dim=0)
    v = k[:, :DV]

    parts, lses = [], []
    for lo, hi in split_bounds(prefix + n, splits):
        s = (q.float() @ k[lo:hi].float().T) * b.sm_scale
        s = s.masked_fill(~visible[:, lo:hi], -math.inf)
        m = s.max(dim=-1, keepdim=True).values
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        ell = p.sum(dim=-1, keepdim=True)
        o = (p.to(torch.bfloat16).float() @ v[lo:hi].float()) / ell.clamp_min(1e-30)
        lse = torch.where(ell > 0, m + torch.log(ell), torch.full_like(m, -math.inf))
        parts.append(o)
        lses.append(lse)
    lse_all = torch.cat(lses, dim=-1)
    mx = lse_all.max(dim=-1, keepdim=True).values
    w = torch.exp(lse_all - mx)
    out = {}
    for name, cast in (("fp32 partials", lambda t: t), ("bf16 partials", lambda t: t.to(torch.bfloat16).float())):
        acc = sum(w[:, i : i + 1] * cast(parts[i]) for i in range(len(parts)))
        o = (acc / w.sum(dim=-1, keepdim=True)).to(torch.bfloat16).reshape(n, heads, DV)
        out[name] = compare.compare(o, ref)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=[],
                    help="bs-less cases N,H,L,S (drafts, heads, prefix, splits); default: a grid of the bench's")
    ap.add_argument("--seeds", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        cases = [tuple(int(x) for x in c.split(",")) for c in args.cases] or list(DEFAULT_CASES)
    except ValueError:
        print(f"--cases: expected N,H,L,S integers, got {args.cases}", file=sys.stderr)
        return 2
    if any(len(c) != 4 or min(c) < 1 for c in cases):
        print(f"--cases: expected four positive integers N,H,L,S each, got {args.cases}", file=sys.stderr)
        return 2
    print(f"limits (oracle): |d| <= {compare.ATOL} + {compare.RTOL} |ref|, cos_diff <= {compare.COS_DIFF_MAX}")
    print("| N | H | prefix | splits | seed | fp32: max excess | fp32: cos_diff | bf16: max excess | bf16: cos_diff |"
          " bf16 passes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, h, L, S in cases:
        for seed in range(args.seeds):
            r = simulate(n, h, L, S, seed)
            a, b = r["fp32 partials"], r["bf16 partials"]
            print(f"| {n} | {h} | {L} | {S} | {seed} | {a.max_rel_excess:.3f} | {a.cos_diff:.2e} | "
                  f"{b.max_rel_excess:.3f} | {b.cos_diff:.2e} | {'yes' if b.passed else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
