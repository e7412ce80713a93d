"""The ``graph`` gate (Phase 4, GPU): the verify kernel is CUDA-graph safe.

    python -m kdtree_pipeline graph [--max-prefix 65536] [--seed 0]

1. Capture the kernel once in a ``torch.cuda.CUDAGraph`` over buffers sized
   for a maximum batch and prefix (:class:`~kdtree_pipeline.graph.capture.VerifyGraph`),
   with ``torch.cuda.set_sync_debug_mode("error")`` around the call path, so
   any host synchronisation in it raises.
2. Replay it for steps with other prefix lengths, slot ids, trees and batch
   padding written into the same buffers; every replay must equal, bit for
   bit, an eager call on the same buffers, and match the fp32 reference.
3. Bad steps (a larger batch, a longer prefix, another draft count, a
   reallocated buffer) are refused on the host before anything is written.
4. Through SGLang's real TritonAttnBackend (its kit's CUDA-graph TARGET_VERIFY
   runner: capture at a padded batch, replay with new metadata), plugin off and
   on in separate processes: both pass SGLang's own checks, and with the plugin
   on the kernel ran inside the captured graph.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kdtree_engine.kernel.op import VerifyArgumentError, verify_attention
from kdtree_pipeline import evidence
from kdtree_pipeline.bench.timing import timed_ms
from kdtree_pipeline.graph.capture import Capacity, VerifyGraph
from kdtree_pipeline.oracle import compare, reference, workloads


def _step(pool: torch.Tensor, prefix_lens: list[int], n: int, heads: int, tree: str, seed: int,
          sm_scale: float) -> workloads.Batch:
    """A step whose slot ids live in the shared pool (random distinct slots, slot 0 excluded)."""
    b = workloads.make_batch(prefix_lens, n, heads, tree=tree, layout="fragmented", seed=seed, device="cpu",
                             poison_unused=False, spare_slots=0, sm_scale=sm_scale)
    gen = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(pool.shape[0] - 1, generator=gen)[: sum(prefix_lens)] + 1
    return workloads.Batch(
        q=b.q.to(pool.device), k_ext=b.k_ext.to(pool.device), kv_buffer=pool,
        qo_indptr=b.qo_indptr.to(pool.device), kv_indptr=b.kv_indptr.to(pool.device),
        kv_indices=slots.to(pool.device), custom_mask=b.custom_mask.to(pool.device),
        mask_indptr=b.mask_indptr.to(pool.device), sm_scale=sm_scale, max_n=n, prefix_lens=prefix_lens,
        n_drafts=b.n_drafts, parents=b.parents, meta=b.meta)


def _eager_same_buffers(vg: VerifyGraph) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(vg.out)
    lse = torch.empty_like(vg.lse)
    verify_attention(vg.q, vg.k_ext, vg.kv_buffer, vg.qo_indptr, vg.kv_indptr, vg.kv_indices, vg.custom_mask,
                     vg.mask_indptr, vg.sm_scale, vg.cap.max_n, out=out, lse=lse, num_splits=vg.num_splits,
                     max_prefix_len=vg.cap.max_prefix_len)
    return out, lse


def run(max_prefix: int, seed: int) -> tuple[bool, dict, list[dict]]:
    dev = torch.device("cuda")
    heads, n, max_bs = 8, 16, 8
    cap = Capacity(max_bs=max_bs, max_n=n, max_prefix_tokens=max_bs * max_prefix + max_bs, num_heads=heads,
                   max_prefix_len=max_prefix)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((cap.max_prefix_tokens + 1, 1, 576), generator=gen).to(torch.bfloat16).to(dev)
    sm_scale = workloads.DEEPSEEK_SM_SCALE
    vg = VerifyGraph(pool, cap, sm_scale)
    rows: list[dict] = []

    torch.cuda.set_sync_debug_mode("error")  # any sync inside the call path raises
    try:
        vg.capture()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    rows.append({"check": "capture under sync_debug_mode=error", "passed": True})

    def fit(lens: list[int]) -> list[int]:  # a small --max-prefix caps the fixed lengths too
        return [min(x, max_prefix) for x in lens]

    steps = [
        ("full batch, long prefixes", fit([max_prefix, max_prefix // 2, 1, 4095, 23000, 7, max_prefix - 1, 64]),
         "eagle"),
        ("3 requests + 5 padded", fit([300, 65, 1000]), "star"),
        ("1 request, no prefix", [0], "best_first"),
        ("full batch, chains", fit([63, 64, 65, 128, 129, 4096, 8191, 2]), "chain"),
        ("5 requests, one at capacity", fit([max_prefix, 17, 0, 900, 33]), "random"),
    ]
    for i, (name, lens, tree) in enumerate(steps):
        b = _step(pool, lens, n, heads, tree, seed + 10 * i, sm_scale)
        vg.load(b)
        vg.out.fill_(float("nan"))
        vg.replay()
        torch.cuda.synchronize()
        g_out, g_lse = vg.out.clone(), vg.lse.clone()
        torch.cuda.set_sync_debug_mode("error")
        try:
            e_out, e_lse = _eager_same_buffers(vg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        T = b.bs * n
        bitwise = bool(torch.equal(g_out, e_out)) and bool(torch.equal(g_lse, e_lse))
        ref, ref_lse = reference.verify_attention_ref(*b.ref_args())
        d = compare.compare(g_out[:T], ref, g_lse[:T], ref_lse)
        ok = bitwise and d.passed
        rows.append({"check": f"replay: {name}", "bs": b.bs, "prefix_lens": lens, "tree": tree,
                     "bitwise_equal_eager": bitwise, "max_abs_vs_ref": d.max_abs, "cos_diff": d.cos_diff,
                     "passed": ok})

    # bad steps: refused on the host, buffers untouched
    snapshot = {k: getattr(vg, k).clone() for k in ("kv_indptr", "kv_indices", "mask_indptr", "q")}
    bad = [
        ("batch larger than captured", lambda: _step(pool, [5] * (max_bs + 1), n, heads, "chain", 99, sm_scale)),
        ("prefix beyond capacity", lambda: _step(pool, [max_prefix + 1], n, heads, "chain", 98, sm_scale)),
        ("other draft count", lambda: _step(pool, [10, 10], n // 2, heads, "chain", 97, sm_scale)),
    ]
    for name, make in bad:
        try:
            vg.load(make())
            refused, msg = False, "accepted"
        except VerifyArgumentError as e:
            refused, msg = True, str(e)
        unchanged = all(torch.equal(getattr(vg, k), v) for k, v in snapshot.items())
        rows.append({"check": f"refuse: {name}", "message": msg, "buffers_unchanged": unchanged,
                     "passed": refused and unchanged})
    old_q = vg.q
    vg.q = torch.zeros_like(old_q)
    try:
        vg.replay()
        refused, msg = False, "replayed"
    except VerifyArgumentError as e:
        refused, msg = True, str(e)
    vg.q = old_q
    rows.append({"check": "refuse: buffer reallocated after capture", "message": msg, "passed": refused})

    # what graphs buy at this size: eager call vs replay (CUDA events, median)
    def med(fn, reps=50):
        return statistics.median(timed_ms(fn) * 1e3 for _ in range(reps))

    vg.load(_step(pool, [max_prefix] * max_bs, n, heads, "eagle", 5, sm_scale))
    t_replay = med(vg.replay)
    t_eager = med(lambda: _eager_same_buffers(vg))
    rows += sglang_graph_rows()
    passed = all(r["passed"] for r in rows)
    metrics = {"checks": len(rows), "failed": sum(not r["passed"] for r in rows),
               "replays_bitwise_equal_eager": sum(bool(r.get("bitwise_equal_eager")) for r in rows),
               "capacity": cap.__dict__, "timing_us": {"bs": max_bs, "prefix": max_prefix, "eager": round(t_eager, 1),
                                                       "replay": round(t_replay, 1)}}
    return passed, metrics, rows


def sglang_graph_rows(timeout: float = 900.0) -> list[dict]:
    """Through SGLang's real TritonAttnBackend: the kit's CUDA-graph TARGET_VERIFY checks
    (capture at a padded batch, replay with new metadata) with KDTREE_VERIFY=off and =on,
    each in its own process; with on, the kernel must have run inside the captured graph."""
    import tempfile

    from kdtree_pipeline import integrate

    with tempfile.TemporaryDirectory(prefix="kdtree-graph-") as tmp:
        out = Path(tmp)
        _, failure = integrate.run_off_on(out, quick=False, timeout=timeout, kit_graph_only=True)
        if failure:
            return [{"check": "sglang backend: CUDA-graph verify, plugin off vs on", "passed": False,
                     "message": failure}]
        ok, problems, details = integrate.compare_runs(out / "off", out / "on", require_cases=False)
    rows = []
    for name, k in details["kit"]["on"].items():
        mine = [pr for pr in problems if name in pr]
        rows.append({"check": f"sglang backend, plugin on vs off: {name}", "kernel_calls": k.get("kernel_calls"),
                     "passed": not mine and bool(k.get("kernel_calls")),
                     "message": "; ".join(mine) or f"{k.get('vs_off')}; kernel calls {k.get('kernel_calls')}"
                     + (f"; note: {k['note']}" if k.get("note") else "")})
    rest = [pr for pr in problems if not any(name in pr for name in details["kit"]["on"])]
    if rest:
        rows.append({"check": "sglang backend: plugin off vs on", "passed": False, "message": "; ".join(rest)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline graph", description=__doc__.splitlines()[0])
    ap.add_argument("--max-prefix", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.max_prefix < 64:
        print("graph: --max-prefix must be at least 64", file=sys.stderr)
        return 2
    rc = evidence.refuse_without_cuda("graph")
    if rc is not None:
        return rc
    t0 = time.monotonic()
    try:
        passed, metrics, rows = run(args.max_prefix, args.seed)
    except Exception as e:  # a crash fails the gate with its text
        msg = f"{type(e).__name__}: {e}"
        print(f"graph: FAILED: {msg}", file=sys.stderr)
        evidence.write_record(evidence.make_record("graph", False, {}, "graph gate crashed", reason=msg))
        return 1
    for r in rows:
        print(f"  {'ok  ' if r['passed'] else 'FAIL'} {r['check']}"
              + (f"  bitwise={r['bitwise_equal_eager']} max|d|={r['max_abs_vs_ref']:.1e}" if "max_abs_vs_ref" in r else "")
              + (f"  ({r['message'][:90]})" if "message" in r else ""))
    t = metrics["timing_us"]
    headline = (f"{metrics['replays_bitwise_equal_eager']} replays bit-equal to eager, {metrics['checks']} checks; "
                f"bs{t['bs']} prefix {t['prefix']}: eager {t['eager']:.0f} us, replay {t['replay']:.0f} us")
    failed = [r["check"] for r in rows if not r["passed"]]
    rec = evidence.make_record("graph", passed, metrics, headline,
                               reason=None if passed else "failed: " + "; ".join(failed), details={"rows": rows})
    path = evidence.write_record(rec)
    print(f"graph: {'PASS' if passed else 'FAIL'}: {headline} ({time.monotonic() - t0:.0f}s, evidence {path})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
