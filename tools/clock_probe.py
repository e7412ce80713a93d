"""What the SM clock and the board power do while each system's replays run back to back.

    KDTREE_LIB=build/lib/libkdtree_verify.so PYTHONPATH=src python3 tools/clock_probe.py \
        --cases bs8-N16-H8-L32768,bs32-N8-H16-L8192 --systems ours,flashmla [--seconds 1.5] [--rounds 2] \
        [--layout contiguous] [--json FILE]

The bench times each system in short interleaved bursts (timing.time_replays, ~0.25 s each).
This tool asks whether the systems leave the GPU in the same state: after the bench's own timing of a
case (gate.run_case, the same inputs and checks), each system's captured graph is replayed with no
gap for ``--seconds`` (the replays are enqueued between two CUDA events, then synchronized), in
``--rounds`` rounds whose order alternates, while a thread reads `nvidia-smi --query-gpu=clocks.sm,
power.draw.instant,temperature.gpu` as fast as it answers (~20-60 ms a reading). Each window's
figures: us per call over the whole window (GPU events), the median SM clock and power of the
readings taken inside it, and the cycles a call took at that clock (`kcycles`, thousands). A system
whose kernels draw more power runs at a lower clock under the H200's power limit
(docs/kernel-notes.md, M9 item 5: a sustained matmul runs ~12% slower than a burst); this tool
measures whether that separates ours from a peer on the same case.

Nothing here is evidence of a gate; `nox -s bench` stays the measurement of record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from kdtree_pipeline.bench import gate, timing
from kdtree_pipeline.bench.data import DEFAULT_L2_BYTES
from kdtree_pipeline.bench.peers import PEERS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: ab_bench's argument checks
import ab_bench  # noqa: E402
import fm_src_peer  # noqa: E402

QUERY = "clocks.sm,power.draw.instant,temperature.gpu"


class Sampler(threading.Thread):
    """nvidia-smi readings, each stamped with the host's clock when it came back."""

    def __init__(self, query: str) -> None:
        super().__init__(daemon=True)
        self.query = query
        self.rows: list[tuple[float, list[float]]] = []
        self.stop = threading.Event()
        self.error: str | None = None

    def read(self) -> list[float]:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={self.query}", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip() or out.stdout.strip())
        return [float(x) for x in out.stdout.strip().split(",")]

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.time()
            try:
                vals = self.read()
            except Exception as e:  # recorded, the probe still times
                self.error = str(e)
                return
            self.rows.append(((t0 + time.time()) / 2, vals))

    def window(self, t0: float, t1: float) -> list[list[float]]:
        return [v for t, v in self.rows if t0 <= t <= t1]


def sustained(preps, labels, sampler: Sampler, seconds: float, rounds: int, out: list[dict]) -> None:
    import torch

    live = [(lab, p) for lab, p in zip(labels, preps, strict=True) if p.graph is not None]
    for rnd in range(rounds):
        order = live if rnd % 2 == 0 else live[::-1]
        for lab, p in order:
            per = timing.timed_ms(p.graph.replay)  # ms per replay, to size the window
            reps = max(3, int(seconds * 1e3 / max(per, 1e-3)))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.time()
            start.record()
            for _ in range(reps):
                p.graph.replay()
            end.record()
            end.synchronize()
            t1 = time.time()
            ms = start.elapsed_time(end)
            # the first and last tenth of the window out: the clock moves as the load starts and stops
            pad = (t1 - t0) / 10
            row = window_row(lab, rnd, ms * 1e3 / (reps * p.m.calls), p.m.replay_us, t1 - t0,
                             sampler.window(t0 + pad, t1 - pad))
            out.append(row)
            print(f"    {lab:22s} round {rnd}: {row['us_per_call']:8.2f} us/call sustained "
                  f"(burst {row['burst_us'] or float('nan'):8.2f})  SM {row['sm_mhz']:6.0f} MHz  "
                  f"{row['kcycles']:6.1f} k cycles/call  {row['power_w']:6.1f} W  {row['temp_c']:4.0f} C  "
                  f"({row['readings']} readings, {row['window_s']:.2f} s)", flush=True)


def window_row(lab: str, rnd: int, us_per_call: float, burst_us, window_s: float, rows: list[list[float]]) -> dict:
    """One window's figures: the medians of its readings, and the cycles a call took at the median
    SM clock (us x MHz), which compares builds that run at different clocks under the power limit
    (docs/kernel-notes.md, AF11: a build without DRAM traffic ran 28% faster in sustained replay but
    took only 8-12% fewer cycles)."""
    med = [statistics.median(c) for c in zip(*rows, strict=True)] if rows else [float("nan")] * 3
    return {"system": lab, "round": rnd, "us_per_call": us_per_call, "burst_us": burst_us, "window_s": window_s,
            "readings": len(rows), "sm_mhz": med[0], "power_w": med[1], "temp_c": med[2],
            "kcycles": us_per_call * med[0] / 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="lib")
    ap.add_argument("--suite", default="micro")
    ap.add_argument("--cases", required=True, help="comma list of case names of the suite")
    ap.add_argument("--systems", default="ours,flashmla")
    ap.add_argument("--masks", default="chain")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default=None,
                    help="slot layout for every case (as ab_bench's; e.g. contiguous, where ours loads by TMA boxes "
                         "unless KDTREE_TMA=0)")
    ap.add_argument("--json", default=None)
    fm_src_peer.add_argument(ap)
    args = ap.parse_args(argv)

    try:
        _, known, names, systems = ab_bench.pick(args.suite, args.cases, args.systems, args.layout,
                                                   args.fm_src)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.seconds <= 0 or args.rounds < 1:
        print(f"--seconds > 0 and --rounds >= 1 expected, got {args.seconds}, {args.rounds}", file=sys.stderr)
        return 2
    sampler = None
    for query in (QUERY, QUERY.replace("power.draw.instant", "power.draw")):  # .instant: newer drivers only
        try:
            Sampler(query).read()
            sampler = Sampler(query)
            break
        except Exception as e:
            err = str(e)
    if sampler is None:
        print(f"nvidia-smi cannot be read ({err}): this probe needs it", file=sys.stderr)
        return 2
    print(f"reading: {sampler.query}", flush=True)
    sampler.start()

    import torch

    masks = tuple(m for m in args.masks.split(",") if m)
    peers = {s: PEERS[s] for s in systems}
    missing = {s: why for s in systems if (why := peers[s].check())}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
    rows: list[dict] = []
    orig = timing.time_replays

    for name in names:
        case = dataclasses.replace(known[name], masks=tuple(m for m in masks if m in known[name].masks),
                                   layout=args.layout or known[name].layout)
        print(f"== {name}", flush=True)

        def patched(preps, case=case, name=name, **kw):
            orig(preps, **kw)
            labels = [f"{s}/{m}" for s in systems if s not in missing for m in PEERS[s].masks(case.masks)]
            if len(labels) != len(preps):  # a system failed before its capture: its place is unknown
                print(f"    {len(preps)} captured runs for {len(labels)} planned ({', '.join(labels)}): "
                      "labelled by position", flush=True)
                labels = [f"run{i}" for i in range(len(preps))]
            found: list[dict] = []
            sustained(preps, labels, sampler, args.seconds, args.rounds, found)
            for r in found:
                r.update(case=name, label=args.label, layout=case.layout)
            rows.extend(found)

        timing.time_replays = patched
        try:
            out: list = []
            gate.run_case(case, systems, peers, missing, l2, gate.case_seed(case, args.seed), out,
                          side_by_side=systems)
        finally:
            timing.time_replays = orig
        for r in out:
            print(f"    bench: {r.system}/{r.mask} {r.replay_us} us {r.status}", flush=True)
            if r.status != "ok":
                print(f"    {r.system}/{r.mask}: {r.status} ({(r.error or '')[:160]})", flush=True)
    sampler.stop.set()
    if sampler.error:
        print(f"nvidia-smi stopped answering: {sampler.error}", file=sys.stderr)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
