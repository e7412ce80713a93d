"""FlashMLA's own page-size-1 gather kernel beside ours and FlashMLA's dense decode, on one workload.

    KDTREE_LIB=build/lib/libkdtree_verify.so PYTHONPATH=src python3 tools/gather_peer_probe.py \
        [--cases 264x2048,132x4096,66x8192] [--layouts fragmented,contiguous] [--json FILE] [--once]

Issue 16 compares our kernel on random slot ids (SGLang's page size 1) with FlashMLA's dense
decode on its own contiguous 64-token pages, which it loads by TMA. FlashMLA also ships a kernel
that gathers 576-wide bf16 rows by token index on Hopper: the sm_90 sparse prefill
(`flash_mla_sparse_fwd(..., use_legacy=True)`, FlashMLA's csrc/sm90/prefill/sparse/phase1.cuh:
64 query rows a CTA, 64-key blocks, two key buffers and Q in shared memory, a producer
warpgroup of 16-byte `cp.async`, no split-KV). It is the field's answer to the problem our
kernel solves, by the authors of the peer we are measured against. This tool times, in one
process and interleaved (bench/timing.py's `prepare` and `time_replays`, CUDA-graph replay):

- `ours`: our op on the batch's slots (random ids for `fragmented`; the TMA fast path for
  `contiguous`); `ours-gather` (contiguous only): the same with `KDTREE_TMA=0`, the gather on
  consecutive rows;
- `flashmla`: FlashMLA's dense decode (bench/peers.py), its pages in a shuffled order;
- `fm-sparse`: FlashMLA's gather kernel with the batch's slots as its indices.

A case `BSxL` is BS requests of N 8, H 16 (128 query rows each: `h_q` 128 for the sparse kernel,
one query "token" a request) over a prefix of L keys (a multiple of 128, the sparse kernel's
step). The sparse kernel has no split-KV, so a case fills the GPU only when BS x 2 is a multiple of
the SM count (132 on the H200: 66, 132, 264). It attends to the prefix alone (not causal; the
verify kernels also see the 8 drafts, 0.4% more keys at 2048). Its output is checked against
an fp32 softmax over the prefix on the first two requests; the other systems against the
oracle's reference. One input set per case: a case's KV (BS x L x 1152 bytes, 623 MB for the
defaults) is ~12x the H200's L2, so a replay finds little of it there.

`--once` makes each system's call twice, eagerly, with nothing timed or checked, for ncu to
catch (gpu_session.sh step `ncu-gather`). Nothing here is evidence of a gate; `nox -s bench`
stays the measurement of record.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

N_DRAFTS, HEADS = 8, 16  # 128 rows a request: the sparse kernel's h_q
SPARSE_STEP = 128        # the sparse kernel's topk must be a multiple of 2 x its 64-key block
SYSTEMS = ("ours", "ours-gather", "flashmla", "fm-sparse")


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'264x2048,66x8192' -> [(264, 2048), (66, 8192)]; a ValueError names the flag and the bad item."""
    out = []
    for item in (c for c in text.split(",") if c):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--cases: expected BSxL with positive integers (e.g. 264x2048), got {item!r}")
        bs, L = int(parts[0]), int(parts[1])
        if L % SPARSE_STEP:
            raise ValueError(f"--cases: L must be a multiple of {SPARSE_STEP} (the sparse kernel's step), got {item!r}")
        out.append((bs, L))
    if not out:
        raise ValueError("--cases: no case given")
    return out


def parse_layouts(text: str) -> list[str]:
    from kdtree_pipeline.oracle import workloads

    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in workloads.LAYOUTS]
    if bad or not names:
        raise ValueError(f"--layouts: expected names of {', '.join(workloads.LAYOUTS)}, got {text!r}")
    return names


def sparse_inputs(batch, L: int):
    """(q [BS, 128, 576], kv [pool, 1, 576], indices [BS, 1, L] int32) of a batch of equal prefixes."""
    import torch

    bs = batch.bs
    q = batch.q.reshape(bs, N_DRAFTS * HEADS, batch.q.shape[-1]).contiguous()
    idx = batch.kv_indices.reshape(bs, 1, L).to(dtype=torch.int32).contiguous()
    return q, batch.kv_buffer, idx


def sparse_runner(fm, q, kv, idx, scale: float):
    """One call of FlashMLA's sm_90 gather kernel (its sparse prefill) -> out [BS, 128, 512]."""
    def run():
        return fm.flash_mla_sparse_fwd(q, kv, idx, scale, 512, use_legacy=True)[0]
    return run


def sparse_ref_rel_l2(out, q, kv, idx, scale: float, requests: int = 2) -> float:
    """Worst relative L2 error of ``out`` against an fp32 softmax over the prefix, first ``requests``."""
    import torch

    worst = 0.0
    for b in range(min(requests, q.shape[0])):
        k = kv[idx[b, 0].long(), 0].float()
        s = (q[b].float() @ k.T) * scale
        ref = torch.softmax(s, dim=-1) @ k[:, :512]
        got = out[b].float()
        worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="264x2048,132x4096,66x8192")
    ap.add_argument("--layouts", default="fragmented,contiguous")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of replays per system and case (default 0.4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="append one JSON line per result here")
    ap.add_argument("--label", default="lib",
                    help="names the library in each JSON line (gpu_session's gather-peer: each GATHER_LIBS folder's name)")
    ap.add_argument("--once", action="store_true",
                    help="no timing: each system's call made twice, eagerly, for a profiler (ncu) to catch")
    args = ap.parse_args(argv)
    try:  # every argument checked before any GPU time is spent
        cases = parse_cases(args.cases)
        layouts = parse_layouts(args.layouts)
        if not args.budget > 0:
            raise ValueError(f"--budget: expected seconds > 0, got {args.budget}")
        if not args.label.strip():
            raise ValueError("--label: expected a name for the library, got an empty one")
    except ValueError as e:
        print(f"gather_peer_probe: {e}", file=sys.stderr)
        return 2

    import torch

    from kdtree_pipeline.bench import timing
    from kdtree_pipeline.bench.peers import PEERS
    from kdtree_pipeline.oracle import reference, workloads

    if not torch.cuda.is_available():
        print("gather_peer_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    fm = importlib.import_module("flash_mla")
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for bs, L in cases:
        for layout in layouts:
            name = f"bs{bs}-N{N_DRAFTS}-H{HEADS}-L{L}"
            print(f"== {name} {layout} ({gpu})", flush=True)
            batch = workloads.make_batch([L] * bs, N_DRAFTS, HEADS, tree="chain", layout=layout,
                                         seed=args.seed, device=dev)
            q, kv, idx = sparse_inputs(batch, L)
            if args.once:  # for ncu: the calls alone, nothing timed or checked here
                tma = os.environ.get("KDTREE_TMA")
                for system in SYSTEMS:
                    if system == "ours-gather" and layout != "contiguous":
                        continue
                    if system == "fm-sparse":
                        run = sparse_runner(fm, q, kv, idx, batch.sm_scale)
                    else:
                        if system == "ours-gather":
                            os.environ["KDTREE_TMA"] = "0"
                        run = PEERS["ours" if system == "ours-gather" else system].prepare(batch)
                    for _ in range(2):
                        run()
                    torch.cuda.synchronize()
                    if tma is None:
                        os.environ.pop("KDTREE_TMA", None)
                    else:
                        os.environ["KDTREE_TMA"] = tma
                    print(f"    {system}: 2 calls", flush=True)
                del batch, q, kv, idx
                torch.cuda.empty_cache()
                continue
            ref = reference.verify_attention_ref(*batch.ref_args())[0]
            preps: list[tuple[str, timing.Prepared]] = []
            for system in SYSTEMS:
                if system == "ours-gather" and layout != "contiguous":
                    continue
                if system == "fm-sparse":
                    run = sparse_runner(fm, q, kv, idx, batch.sm_scale)
                    out = run()
                    torch.cuda.synchronize()
                    err = sparse_ref_rel_l2(out, q, kv, idx, batch.sm_scale)
                    print(f"    fm-sparse vs fp32 softmax over the prefix (2 requests): rel_l2 {err:.1e}", flush=True)
                    if not err < 2e-2:
                        print("    fm-sparse: WRONG OUTPUT", flush=True)
                    preps.append((system, timing.prepare([run], out.detach().clone())))
                    continue
                peer = PEERS["ours" if system == "ours-gather" else system]
                old = os.environ.get("KDTREE_TMA")
                if system == "ours-gather":
                    os.environ["KDTREE_TMA"] = "0"  # read at each launch: the captured graph keeps the gather
                try:
                    preps.append((system, timing.prepare([peer.prepare(batch)], ref)))
                finally:
                    if system == "ours-gather":
                        if old is None:
                            os.environ.pop("KDTREE_TMA", None)
                        else:
                            os.environ["KDTREE_TMA"] = old
            timing.time_replays([p for _, p in preps], budget_s=args.budget)
            base = {s: p.m.replay_us for s, p in preps}
            for system, p in preps:
                m = p.m
                if m.replay_us is None:  # not capturable: its eager figure (host launch path included)
                    timing.time_eager(p, budget_s=args.budget)
                row = dict(label=args.label, lib=os.environ.get("KDTREE_LIB", ""), case=name, bs=bs, L=L,
                           layout=layout, system=system, replay_us=m.replay_us,
                           eager_us=m.eager_us, reps=m.replay_reps, calls=m.calls, correct=m.correct, gpu=gpu,
                           graph_error=m.graph_error)
                rows.append(row)
                ratio = ""
                if m.replay_us and base.get("flashmla"):
                    ratio = f"  / flashmla {m.replay_us / base['flashmla']:.3f}"
                if m.replay_us and base.get("fm-sparse") and system != "fm-sparse":
                    ratio += f"  / fm-sparse {m.replay_us / base['fm-sparse']:.3f}"
                us = (f"{m.replay_us:9.2f} us" if m.replay_us is not None
                      else f"eager {m.eager_us:.2f} us ({(m.graph_error or '')[:60]})")
                print(f"    {system:12s} {us}  x{m.calls} calls, {m.replay_reps} reps  "
                      f"{'ok' if m.correct else 'WRONG OUTPUT'}{ratio}", flush=True)
                p.release()
            del preps, batch, ref, q, kv, idx
            torch.cuda.empty_cache()
    if args.json:
        with Path(args.json).open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
