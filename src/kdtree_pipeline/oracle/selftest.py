"""The ``oracle-selftest`` gate (Phase 0, CPU): is the fp32 reference right?

    python -m kdtree_pipeline oracle-selftest [--write-golden]

1. The fp32 reference (:func:`reference.verify_attention_ref`, vectorised,
   reads the FULL_MASK) against an independent formulation
   (:func:`reference.verify_attention_loop`: float64, one row and one key at a
   time, visibility from walking the tree's parent pointers) on seeded random
   batches including the edge cases: prefix 0, one draft, a deep chain, a
   wide star, ragged batches with a request of zero drafts.
2. Golden vectors: ``golden.pt`` beside this file holds fixed inputs and the
   float64 loop's outputs; the reference must reproduce them. The file's
   sha256 goes into the evidence, so a changed golden set is visible.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

from kdtree_pipeline import evidence
from kdtree_pipeline.oracle import compare, reference, workloads

GOLDEN = Path(__file__).with_name("golden.pt")

#: (name, prefix_lens, n_drafts, heads, tree kinds, layout, mask dtype)
CASES = [
    ("prefix0-one-draft", [0], [1], 2, ["chain"], "contiguous", torch.bool),
    ("prefix0-eagle", [0], [8], 2, ["eagle"], "contiguous", torch.uint8),
    ("one-draft", [9], [1], 3, ["chain"], "fragmented", torch.uint8),
    ("deep-chain", [4], [32], 1, ["chain"], "fragmented", torch.bool),
    ("wide-star", [7], [32], 1, ["star"], "runs16", torch.uint8),
    ("deep-narrow", [12], [16], 2, ["deep"], "fragmented", torch.uint8),
    ("best-first", [20], [16], 2, ["best_first"], "fragmented", torch.bool),
    ("random-tree", [3], [12], 2, ["random"], "contiguous", torch.uint8),
    ("ragged-with-empty", [5, 0, 11, 2], [4, 0, 6, 1], 2, ["eagle", "chain", "best_first", "star"],
     "fragmented", torch.uint8),
]
GOLDEN_CASES = ("prefix0-eagle", "ragged-with-empty")


def _batch(case, seed: int) -> workloads.Batch:
    name, lens, ns, h, kinds, layout, mdt = case
    return workloads.make_batch(lens, ns, h, tree=kinds, layout=layout, mask_dtype=mdt, seed=seed,
                                spare_slots=8)


def write_golden(path: Path = GOLDEN, seed: int = 1234) -> Path:
    data = {}
    for case in CASES:
        if case[0] not in GOLDEN_CASES:
            continue
        b = _batch(case, seed)
        out, lse = reference.verify_attention_loop(b.q, b.k_ext, b.kv_buffer, b.qo_indptr, b.kv_indptr,
                                                   b.kv_indices, b.parents, b.sm_scale)
        data[case[0]] = {
            "q": b.q, "k_ext": b.k_ext, "kv_buffer": b.kv_buffer, "qo_indptr": b.qo_indptr,
            "kv_indptr": b.kv_indptr, "kv_indices": b.kv_indices, "custom_mask": b.custom_mask,
            "mask_indptr": b.mask_indptr, "sm_scale": torch.tensor(b.sm_scale, dtype=torch.float64),
            "out": out.float(), "lse": lse.float(),
        }
    torch.save(data, path)
    return path


#: fp32 against float64 of the same math: far tighter than the bf16 tolerance
SELF_ATOL = 1e-4


def _close(d: compare.Diff) -> bool:
    return d.nonfinite == 0 and d.max_abs < SELF_ATOL and (d.lse_max_abs or 0.0) < SELF_ATOL


def _ref_vs_loop(seed: int) -> list[dict]:
    """The vectorised fp32 reference against the float64 loop on every case."""
    rows = []
    for case in CASES:
        b = _batch(case, seed)
        out, lse = reference.verify_attention_ref(*b.ref_args())
        lo, ll = reference.verify_attention_loop(b.q, b.k_ext, b.kv_buffer, b.qo_indptr, b.kv_indptr,
                                                 b.kv_indices, b.parents, b.sm_scale)
        d = compare.compare(out, lo, lse, ll)
        rows.append({"check": "ref-vs-loop", "case": case[0], "max_abs": d.max_abs,
                     "lse_max_abs": d.lse_max_abs, "passed": _close(d)})
    return rows


def _golden() -> tuple[list[dict], str | None]:
    """The reference against the golden vectors; the rows and the golden file's sha256
    (a failing row and None when the file is missing)."""
    if not GOLDEN.is_file():
        return [{"check": "golden", "case": str(GOLDEN), "passed": False, "error": "golden file missing"}], None
    rows = []
    for name, g in torch.load(GOLDEN, weights_only=True).items():
        out, lse = reference.verify_attention_ref(
            g["q"], g["k_ext"], g["kv_buffer"], g["qo_indptr"], g["kv_indptr"], g["kv_indices"],
            g["custom_mask"], g["mask_indptr"], float(g["sm_scale"]))
        d = compare.compare(out, g["out"], lse, g["lse"])
        rows.append({"check": "golden", "case": name, "max_abs": d.max_abs, "lse_max_abs": d.lse_max_abs,
                     "passed": _close(d)})
    return rows, hashlib.sha256(GOLDEN.read_bytes()).hexdigest()


def run(seed: int = 0) -> tuple[bool, dict, list[dict]]:
    rows = _ref_vs_loop(seed)
    golden_rows, golden_sha = _golden()
    rows += golden_rows
    passed = all(r["passed"] for r in rows) and len(rows) > len(CASES)
    worst = max((r.get("max_abs") or 0.0) for r in rows)
    metrics = {"cases": len(rows), "passed_cases": sum(r["passed"] for r in rows), "worst_max_abs": worst,
               "golden_sha256": golden_sha}
    return passed, metrics, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline oracle-selftest", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-golden", action="store_true", help="regenerate golden.pt (then review the diff)")
    args = ap.parse_args(argv)
    if args.write_golden:
        print(f"oracle-selftest: wrote {write_golden()}")
    passed, metrics, rows = run(args.seed)
    for r in rows:
        print(f"  {r['check']:12s} {r['case']:22s} max|d|={r.get('max_abs', float('nan')):.2e} "
              f"{'ok' if r['passed'] else 'FAIL ' + r.get('error', '')}")
    headline = (f"reference = float64 loop on {metrics['cases']} cases (worst |d| {metrics['worst_max_abs']:.1e}), "
                f"golden {str(metrics['golden_sha256'])[:12]}")
    failed = [r["case"] for r in rows if not r["passed"]]
    rec = evidence.make_record("oracle-selftest", passed, metrics, headline,
                               reason=None if passed else f"failed: {', '.join(failed)}",
                               details={"rows": rows}, device=None)
    path = evidence.write_record(rec)
    print(f"oracle-selftest: {'PASS' if passed else 'FAIL'} (evidence {path})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
