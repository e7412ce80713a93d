"""The ``oracle`` gate (Phases 1-2, GPU): the kernel against the fp32 reference.

    python -m kdtree_pipeline oracle [--groups prefix_n,heads,...] [--seed 0] [--list]

Every case builds a seeded batch in SGLang's layout (slot 0 padding, unused
slots poisoned with NaN, FULL_MASK masks), poisons the kernel's outputs with
NaN, runs the kernel with LSE, and compares with the fp32 reference on the
same GPU (:mod:`kdtree_pipeline.oracle.compare` has the tolerances). The matrix
covers prefix lengths {0, 1, 63, 64, 65, 4095, 23000, 65536, 131072}, N {1, 2,
7, 16, 64, 128}, H {1, 8, 16, 64, 128}, bs {1, 3, 32}, ragged N (a request
with none too), every tree shape, bool and uint8 masks, contiguous /
fragmented / run layouts, int32 and int64 slot ids, several sm_scale values,
forced split counts (combine path, unneeded splits), strided q / out and int64
indptrs. The matrix runs once per target (``--targets``): natively, and in the
sm_120 emulation (``target="sm_120"``: the kernel and tile an RTX PRO 6000
Blackwell runs, under its limits) on any GPU of compute capability >= 9.0 that is
not itself an sm_120. Evidence: case count and the worst error per target and group.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from kdtree_engine.kernel import library
from kdtree_pipeline import evidence
from kdtree_pipeline.oracle import compare, reference, workloads

PREFIXES = (0, 1, 63, 64, 65, 4095, 23000, 65536, 131072)
NS = (1, 2, 7, 16, 64, 128)
HEADS = (1, 8, 16, 64, 128)


@dataclass
class Case:
    group: str
    name: str
    prefix_lens: list[int]
    n_drafts: list[int]
    heads: int
    tree: list[str] = field(default_factory=lambda: ["eagle"])
    layout: str = "fragmented"
    mask_dtype: torch.dtype = torch.uint8
    sm_scale: float = workloads.DEEPSEEK_SM_SCALE
    num_splits: int | None = None
    index_dtype: torch.dtype = torch.int64
    strided: bool = False
    max_n: int | None = None
    keys: str = "random"  # or "ramp" / "spike": see shape_keys
    indptr_dtype: torch.dtype = torch.int32  # qo_indptr / kv_indptr (SGLang passes int64 qo_indptr)
    drafts_in_pool: bool = False  # k_ext None: the drafts' latents at shuffled pool slots (draft_slots)


def cases() -> list[Case]:
    cs: list[Case] = []
    for L in PREFIXES:
        for n in NS:
            cs.append(Case("prefix_n", f"L{L}-N{n}-H8", [L], [n], 8))
    for h in (1, 16, 64, 128):
        for n in (1, 7, 16, 64):
            for L in (65, 4095):
                cs.append(Case("heads", f"L{L}-N{n}-H{h}", [L], [n], h))
    cs.append(Case("heads", "L4095-N128-H128", [4095], [128], 128))
    cs.append(Case("heads", "L65536-N16-H128", [65536], [16], 128))
    cs += [
        Case("batch", "bs3-uniform", [0, 64, 4095], [7, 7, 7], 16, ["eagle", "chain", "star"]),
        Case("batch", "bs3-ragged", [63, 23000, 1], [1, 16, 7], 8, ["chain", "best_first", "deep"]),
        Case("batch", "bs3-ragged-empty", [65, 4095, 200], [7, 0, 2], 8, ["eagle", "chain", "random"]),
        Case("batch", "bs32-uniform", [int(x) for x in torch.randint(0, 23000, (32,), generator=torch.Generator().manual_seed(7))],
             [16] * 32, 8, list(workloads.TREE_KINDS)),
        Case("batch", "bs32-ragged", [int(x) for x in torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(8))],
             [int(x) for x in torch.randint(1, 65, (32,), generator=torch.Generator().manual_seed(9))], 16,
             list(workloads.TREE_KINDS)),
        Case("batch", "bs32-N4-H16", [4096] * 32, [4] * 32, 16, ["eagle"], layout="runs16"),
    ]
    for kind in workloads.TREE_KINDS:
        for mdt in (torch.bool, torch.uint8):
            cs.append(Case("masks", f"{kind}-{str(mdt).split('.')[-1]}", [1000], [64], 16, [kind], mask_dtype=mdt))
    for layout in workloads.LAYOUTS:
        cs.append(Case("layouts", f"{layout}", [23000], [16], 8, layout=layout))
    cs.append(Case("layouts", "int32-slot-ids", [23000], [16], 8, index_dtype=torch.int32))
    for sc in (workloads.DEEPSEEK_SM_SCALE, 0.1352, 1.0, 0.01):
        cs.append(Case("sm_scale", f"scale{sc:.4f}", [4095], [16], 8, sm_scale=sc))
    for s in (1, 2, 3, 17, 64, 200):
        cs.append(Case("splits", f"splits{s}", [4095], [16], 8, num_splits=s))
    cs.append(Case("splits", "prefix0-splits8", [0], [16], 8, num_splits=8))
    # a grid of 64 splits over prefixes that need few, as under CUDA-graph capture where the host
    # has no prefix lengths and sizes the grid for the most splits: on the device each request
    # takes only the splits its length needs, and a request of one split writes the output
    # without the combine
    cs += [
        Case("splits", "splits64-L300", [300], [16], 8, num_splits=64),
        Case("splits", "splits64-L300-N1", [300], [1], 8, num_splits=64),
        Case("splits", "splits64-L1000", [1000], [16], 8, num_splits=64),
        Case("splits", "splits64-L1000-N64", [1000], [64], 8, num_splits=64),
        # the one-pass combine (csrc/combine.cuh combine_onepass_kernel) with fewer splits on
        # the device than the grid's: 16 under its 10-per-group instance, 12 under the 4-per-group one
        Case("splits", "splits64-L2000", [2000], [16], 8, num_splits=64),
        Case("splits", "splits17-L1500", [1500], [16], 8, num_splits=17),
        # the narrow combine's 16-split instance with fewer splits on the device (11 with the
        # sm_90 tile's 128-key steps, 15 with the sm_120 tile's 32-key ones)
        Case("splits", "splits16-L4095", [4095], [16], 8, num_splits=16),
        Case("splits", "splits64-bs3-L0-100-5000", [0, 100, 5000], [1, 16, 64], 8, ["eagle", "chain", "star"],
             num_splits=64),
    ]
    # running maxima that move late: the kernel re-agrees a row's maximum only when it jumps
    cs += [
        Case("rescale", "ramp-L23000", [23000], [16], 8, keys="ramp"),
        Case("rescale", "ramp-L4095-splits1", [4095], [16], 8, keys="ramp", num_splits=1),
        Case("rescale", "spike-L65536", [65536], [16], 8, keys="spike"),
        Case("rescale", "spike-L4095-splits1-H64", [4095], [7], 64, keys="spike", num_splits=1),
    ]
    cs += [
        Case("edge", "strided-q-out", [4095], [16], 8, strided=True),
        Case("edge", "int64-indptrs", [4095], [16], 8, indptr_dtype=torch.int64),
        Case("edge", "drafts-in-pool", [4095], [16], 8, drafts_in_pool=True),
        Case("edge", "drafts-in-pool-bs3-int64", [63, 23000, 0], [16, 4, 7], 8, ["eagle", "chain", "star"],
             num_splits=3, indptr_dtype=torch.int64, drafts_in_pool=True),
        Case("edge", "int64-indptrs-bs3-splits5", [63, 23000, 0], [16, 4, 7], 8, ["eagle", "chain", "star"],
             num_splits=5, indptr_dtype=torch.int64),
        Case("edge", "max_n-above-N", [100, 7], [5, 3], 4, max_n=32),
        Case("edge", "one-row", [0], [1], 1),
    ]
    return cs


def shape_keys(b: workloads.Batch, how: str) -> None:
    """Make request 0's scores move late in its prefix. "ramp" scales the rope columns of
    key j by 1 + 39 j / L (every few tiles some row's maximum jumps by more than 2^8 in
    log2 units); "spike" replaces one key near the end with twice the request's first
    query row (that row's maximum jumps by ~200 in one of the last tiles)."""
    if how == "random":
        return
    lo, hi = int(b.kv_indptr[0]), int(b.kv_indptr[1])
    slots = b.kv_indices[lo:hi].long()
    kv = b.kv_buffer.view(b.kv_buffer.shape[0], -1)
    if how == "ramp":  # the rope columns only: scores move, V (columns :512) stays O(1)
        f = torch.linspace(1.0, 40.0, hi - lo, device=kv.device)[:, None]
        kv[slots, 512:] = (kv[slots, 512:].float() * f).to(kv.dtype)
    elif how == "spike":
        kv[slots[-min(100, hi - lo)]] = (b.q[int(b.qo_indptr[0]), 0].float() * 2).to(kv.dtype)
    else:
        raise ValueError(f"keys: expected random, ramp or spike, got {how!r}")


def run_case(c: Case, seed: int, device: torch.device, target: str = "native") -> dict:
    from kdtree_engine.kernel.op import verify_attention

    b = workloads.make_batch(c.prefix_lens, c.n_drafts, c.heads, tree=c.tree, layout=c.layout,
                             mask_dtype=c.mask_dtype, sm_scale=c.sm_scale, seed=seed, device=device,
                             index_dtype=c.index_dtype, max_n=c.max_n)
    shape_keys(b, c.keys)
    qo_indptr, kv_indptr = b.qo_indptr.to(c.indptr_dtype), b.kv_indptr.to(c.indptr_dtype)
    T, H = b.q.shape[0], b.q.shape[1]
    k_ext, kv_buffer, draft_slots = b.k_ext, b.kv_buffer, None
    if c.drafts_in_pool:  # as SGLang with k None: the drafts were written to the pool at out_cache_loc
        P = b.kv_buffer.shape[0]
        g = torch.Generator().manual_seed(seed)
        draft_slots = (P + torch.randperm(T, generator=g)).to(device)
        kv_buffer = torch.cat([b.kv_buffer, torch.full_like(b.kv_buffer[:T], float("nan"))])
        kv_buffer[draft_slots] = b.k_ext.view(T, *b.kv_buffer.shape[1:])
        k_ext = None
    q = b.q
    if c.strided:  # q rows inside a wider buffer, out as a view of a wider buffer
        big = torch.randn((T, H + 3, 576 + 64), device=device).to(torch.bfloat16)
        big[:, :H, :576] = b.q
        q = big[:, :H, :576]
        out_big = torch.full((T, H + 1, 512 + 128), float("nan"), dtype=torch.bfloat16, device=device)
        out = out_big[:, 1:, 64:576]
    else:
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((T, H), float("nan"), dtype=torch.float32, device=device)
    verify_attention(q, k_ext, kv_buffer, qo_indptr, kv_indptr, b.kv_indices, b.custom_mask,
                     b.mask_indptr, b.sm_scale, b.max_n, out=out, lse=lse, num_splits=c.num_splits,
                     prefix_lens_cpu=b.prefix_lens, target=target, draft_slots=draft_slots)
    torch.cuda.synchronize()
    ref, ref_lse = reference.verify_attention_ref(*b.ref_args())
    d = compare.compare(out, ref, lse, ref_lse)
    if c.strided:  # the bytes around the view must be untouched
        spill = torch.isfinite(out_big[:, 0]).any() or torch.isfinite(out_big[:, 1:, :64]).any() \
            or torch.isfinite(out_big[:, 1:, 576:]).any()
        if spill:
            d.passed = False
    return {"target": target, "group": c.group, "case": c.name, "rows": T * H, **d.as_dict()}


def default_targets(device_index: int = 0) -> list[str]:
    """native, plus the sm_120 emulation where this GPU can run it (CC >= 9.0, not sm_120)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    return ["native", "sm_120"] if (major, minor) >= (9, 0) and major != 12 else ["native"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline oracle", description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default=None, help="comma list of case groups (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--targets", default=None,
                    help="comma list of native, sm_120 (default: native, and sm_120 emulation on CC >= 9.0)")
    return ap


def _names(arg: str) -> list[str]:
    return [x.strip() for x in arg.split(",") if x.strip()]


def select_cases(groups: str | None) -> list[Case]:
    """The cases of the groups in ``groups`` (a comma list; every case when None or empty);
    ValueError naming the unknown groups and the known ones."""
    all_cases = cases()
    if not groups:
        return all_cases
    known = sorted({c.group for c in all_cases})
    want = _names(groups)
    bad = [g for g in want if g not in known]
    if bad:
        raise ValueError(f"unknown group(s) {bad}; expected some of {known}")
    return [c for c in all_cases if c.group in want]


def parse_targets(arg: str | None) -> list[str] | None:
    """The targets of ``--targets`` (None when not given: :func:`default_targets` decides once a
    GPU is there); ValueError naming the unknown ones, or the argument when it names none."""
    if not arg:
        return None
    targets = _names(arg)
    bad = [t for t in targets if t not in library.TARGETS]
    if bad or not targets:
        raise ValueError(f"--targets: unknown target(s) {bad or arg!r}; expected some of {list(library.TARGETS)}")
    return targets


class NotRun(RuntimeError):
    """The cases could not run (no kernel library, a target the GPU lacks); ``headline`` is the
    record's, the message its reason."""

    def __init__(self, reason: str, headline: str) -> None:
        super().__init__(reason)
        self.headline = headline


def load_library():
    try:
        return library.load()
    except Exception as e:  # missing library, wrong ABI
        raise NotRun(f"cannot load the kernel library: {e}", "not run: no kernel library") from None


def kernel_names(lib, targets: list[str]) -> dict[str, str]:
    """target -> the kernel the library runs for it on this GPU."""
    kernels = {}
    for t in targets:
        try:
            kernels[t] = lib.kernel_name(torch.cuda.current_device(), library.TARGETS[t])
        except Exception as e:  # e.g. sm_120 emulation asked of a GPU below CC 9.0
            msg = f"target {t}: {e}"
            raise NotRun(msg, f"not run: {msg}") from None
    return kernels


def _run_or_crash(c: Case, seed: int, device: torch.device, target: str) -> dict:
    try:
        return run_case(c, seed, device, target)
    except Exception as e:  # a crash is a failed case, reported with its text
        r = {"target": target, "group": c.group, "case": c.name, "passed": False,
             "error": f"{type(e).__name__}: {e}"}
        torch.cuda.synchronize()
        return r


def _case_line(c: Case, r: dict) -> str:
    status = "ok " if r["passed"] else "FAIL"
    if "max_abs" in r:
        detail = f"max|d|={r['max_abs']:.2e} cos={r['cos_diff']:.1e} lse={r['lse_max_abs'] or 0:.1e}"
    else:
        detail = r.get("error", "")
    return f"  {status} {r['target']:6s} {c.group:9s} {c.name:22s} " + detail


def run_all(chosen: list[Case], kernels: dict[str, str], seed: int, device: torch.device) -> list[dict]:
    """Every case on every target (in ``kernels``' order), printing a line per case; case i
    is seeded ``seed + i`` on each target."""
    rows = []
    for t, kernel in kernels.items():
        print(f"oracle: target {t}: {kernel}", flush=True)
        for i, c in enumerate(chosen):
            rows.append(_run_or_crash(c, seed + i, device, t))
            print(_case_line(c, rows[-1]), flush=True)
    return rows


def _group_worst(rows: list[dict]) -> dict:
    """Count, failures and the worst errors of one group's rows (a crashed case, which has no
    errors, counts as an infinite one)."""
    return {
        "cases": len(rows),
        "failed": sum(not r["passed"] for r in rows),
        "max_abs": max((r.get("max_abs", float("inf")) for r in rows), default=0.0),
        "cos_diff": max((r.get("cos_diff", float("inf")) for r in rows), default=0.0),
        "lse_max_abs": max(((r.get("lse_max_abs") or 0.0) if "max_abs" in r else float("inf") for r in rows),
                           default=0.0),
    }


def worst_per_group(rows: list[dict], targets: list[str]) -> dict[str, dict]:
    """``group`` (one target) or ``target/group`` -> :func:`_group_worst` of its rows."""
    worst = {}
    for key in sorted({(r["target"], r["group"]) for r in rows}):
        name = key[1] if len(targets) == 1 else f"{key[0]}/{key[1]}"
        worst[name] = _group_worst([r for r in rows if (r["target"], r["group"]) == key])
    return worst


def per_target(rows: list[dict], kernels: dict[str, str]) -> dict[str, dict]:
    return {t: {"kernel": k, "cases": sum(r["target"] == t for r in rows),
                "passed": sum(r["target"] == t and r["passed"] for r in rows)} for t, k in kernels.items()}


def headline_of(targets: dict[str, dict], worst: dict[str, dict]) -> str:
    worst_abs = max((w["max_abs"] for w in worst.values()), default=0.0)
    worst_cos = max((w["cos_diff"] for w in worst.values()), default=0.0)
    return ("; ".join(f"{v['passed']}/{v['cases']} {t} ({v['kernel']})" for t, v in targets.items())
            + f" within bf16 tolerance; worst |d| {worst_abs:.1e}, cos_diff {worst_cos:.1e}")


def record_results(rows: list[dict], kernels: dict[str, str], archs: list[str], elapsed: float) -> int:
    """Write the gate's record from its rows, print the verdict and the worst per group; the
    exit code (0 when every case passed)."""
    worst = worst_per_group(rows, list(kernels))
    failed = [f"{r['target']}/{r['group']}/{r['case']}" for r in rows if not r["passed"]]
    passed = not failed and len(rows) > 0
    targets = per_target(rows, kernels)
    headline = headline_of(targets, worst)
    metrics = {"cases": len(rows), "failed": len(failed), "targets": targets, "worst_per_group": worst,
               "seconds": round(elapsed, 1), "library_archs": archs,
               "tolerance": {"atol": compare.ATOL, "rtol": compare.RTOL, "cos_diff": compare.COS_DIFF_MAX,
                             "lse_atol": compare.LSE_ATOL}}
    rec = evidence.make_record("oracle", passed, metrics, headline,
                               reason=None if passed else f"{len(failed)} case(s) failed: {', '.join(failed[:10])}",
                               details={"rows": rows})
    path = evidence.write_record(rec)
    print(f"\noracle: {'PASS' if passed else 'FAIL'}: {headline} in {elapsed:.0f}s (evidence {path})")
    for g, w in worst.items():
        print(f"  {g:9s} {w['cases']:4d} cases, {w['failed']} failed, worst |d| {w['max_abs']:.2e}, "
              f"cos {w['cos_diff']:.1e}, lse {w['lse_max_abs']:.1e}")
    return 0 if passed else 1


def _list(chosen: list[Case]) -> int:
    for c in chosen:
        print(f"{c.group:9s} {c.name}")
    print(f"{len(chosen)} cases")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        chosen, targets = select_cases(args.groups), parse_targets(args.targets)
    except ValueError as e:
        print(f"oracle: {e}", file=sys.stderr)
        return 2
    if args.list:
        return _list(chosen)
    rc = evidence.refuse_without_cuda("oracle")
    if rc is not None:
        return rc
    try:
        lib = load_library()
        kernels = kernel_names(lib, targets or default_targets(torch.cuda.current_device()))
    except NotRun as e:
        print(f"oracle: FAILED: {e}", file=sys.stderr)
        evidence.write_record(evidence.make_record("oracle", False, {}, e.headline, reason=str(e)))
        return 1
    t0 = time.monotonic()
    rows = run_all(chosen, kernels, args.seed, torch.device("cuda"))
    return record_results(rows, kernels, lib.archs, time.monotonic() - t0)

if __name__ == "__main__":
    sys.exit(main())
