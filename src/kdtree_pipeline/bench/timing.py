"""Time one system on one case, two ways, and check its outputs.

- **replay** (the primary figure): ``calls`` verify calls over the rotated input
  sets are captured in one ``torch.cuda.CUDAGraph``; each replay is timed with
  CUDA events; figure = median replay time / calls. This is the kernel's
  speed without the Python launch path (SGLang captures verify in graphs).
- **eager**: the same ``calls`` launched back to back from Python between two
  CUDA events (median over repetitions, per call): what an eager server pays,
  host overhead included whenever it exceeds the GPU time. (``do_bench``'s L2
  flush before every call would hide the host overhead behind the flush.)

Correctness: the first eager call of set 0 and the first replay of set 0
(its output poisoned with NaN just before) are compared with the fp32
reference (:func:`kdtree_pipeline.oracle.compare.compare`).

A peer that cannot be captured is still timed eagerly; ``graph_error`` says why.

Side by side: :func:`prepare` checks and captures a runner set, and
:func:`time_replays` times several captured sets in interleaved rounds, so that
the ratios the bench's targets take between them (tree against chain, the
sm_120 emulation against the Hopper kernel) do not depend on which was timed
first. :func:`measure` is the three steps for one set alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kdtree_pipeline.graph.capture import capture_graph
from kdtree_pipeline.oracle import compare

Runner = Callable[[], torch.Tensor]


@dataclass
class Measurement:
    replay_us: float | None = None
    eager_us: float | None = None
    graph_error: str | None = None
    rotations: int = 1
    calls: int = 1
    replay_reps: int = 0
    eager_reps: int = 0
    check_eager: dict[str, Any] | None = None
    check_replay: dict[str, Any] | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def correct(self) -> bool:
        checks = [c for c in (self.check_eager, self.check_replay) if c is not None]
        return bool(checks) and all(c["passed"] for c in checks)


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def timed_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn`` between two CUDA events."""
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def replay_us(fn: Callable[[], Any], *, calls: int = 20, reps: int = 50) -> float:
    """Median microseconds per call of ``fn`` replayed from one CUDA graph of
    ``calls`` back-to-back calls: the GPU's time without the Python launch path,
    which dominates a ~50 us kernel."""
    g, _ = capture_graph(lambda: [fn() for _ in range(calls)])
    g.replay()
    torch.cuda.synchronize()
    return _median([timed_ms(g.replay) for _ in range(reps)]) * 1e3 / calls


def _reps(budget_s: float, ms_per_rep: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(budget_s * 1e3 / max(ms_per_rep, 1e-3))))


@dataclass
class Prepared:
    """A runner set that was checked and captured, its replays not yet timed
    (:func:`prepare`; then :func:`time_replays`, alone or beside others, and :func:`time_eager`)."""

    fns: Sequence[Runner]
    m: Measurement
    graph: Any = None  # the captured graph of ``m.calls`` calls, None if it could not be captured
    timed: bool = False  # time_replays ran on it (successfully or not)

    def release(self) -> None:
        self.graph = None


def prepare(fns: Sequence[Runner], ref: torch.Tensor, *, max_graph_ms: float = 60.0,
            graph: bool = True) -> Prepared:
    """Warm up and check ``fns`` (one runner per rotated input set) eagerly, then capture
    ``calls`` of them in one graph and check its first replay (output poisoned first)."""
    m = Measurement(rotations=len(fns))
    out0 = fns[0]()
    for f in fns[1:]:
        f()
    torch.cuda.synchronize()
    m.check_eager = compare.compare(out0.reshape(ref.shape), ref).as_dict()

    t_est = min(timed_ms(fns[0]) for _ in range(3))
    calls = len(fns)
    if t_est * calls > max_graph_ms:
        calls = max(1, int(max_graph_ms / max(t_est, 1e-3)))
    m.calls = calls
    p = Prepared(fns, m)
    if graph:
        try:
            g, outs = capture_graph(lambda: [fns[i % len(fns)]() for i in range(calls)])
            outs[0].fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            m.check_replay = compare.compare(outs[0].reshape(ref.shape), ref).as_dict()
            p.graph = g
        except Exception as e:  # a peer that cannot be captured: its eager figure stands
            _graph_failed(p, e)
    return p


def _graph_failed(p: Prepared, e: BaseException) -> None:
    p.m.graph_error = f"{type(e).__name__}: {str(e)[:300]}"
    p.m.replay_us = None
    p.release()
    try:
        torch.cuda.synchronize()
    except Exception:
        pass


def time_replays(preps: Sequence[Prepared], *, budget_s: float = 0.25, min_reps: int = 3,
                 max_reps: int = 100) -> None:
    """Time the captured graphs of ``preps`` side by side: each gets its own repetitions
    (``budget_s`` of its replays, within [min_reps, max_reps]), taken in interleaved rounds
    whose order alternates (forward, then backward), so that no runner is timed only in the
    state the previous one left the GPU in. The GPU's clock follows its power and heat: on
    the H200, bs16 N8 H128 8k read 475-493 us when timed first after the inputs were built
    and 514-522 us when timed after another runner, whatever its mask. Figure per runner:
    the median replay / calls. A failure ends the graph figure of every runner not timed
    yet (their eager figures stand)."""
    live = [p for p in preps if p.graph is not None and not p.timed]
    times: list[list[float]] = [[] for _ in live]  # times[i]: live[i]'s replays
    try:
        want = [_reps(budget_s, timed_ms(p.graph.replay), min_reps, max_reps) for p in live]
        rnd = 0
        while True:
            order = range(len(live)) if rnd % 2 == 0 else range(len(live) - 1, -1, -1)
            todo = [i for i in order if len(times[i]) < want[i]]
            if not todo:
                break
            for i in todo:
                times[i].append(timed_ms(live[i].graph.replay))
            rnd += 1
    except Exception as e:
        for p in live:
            p.timed = True
            _graph_failed(p, e)
        return
    for p, t in zip(live, times, strict=True):
        p.timed = True
        p.m.replay_reps = len(t)
        p.m.samples["replay_ms"] = t
        p.m.replay_us = _median(t) * 1e3 / p.m.calls


def time_eager(p: Prepared, *, budget_s: float = 0.25, min_reps: int = 3, max_reps: int = 100) -> None:
    """The eager figure: ``calls`` launches back to back from Python, median per call."""
    fns, calls = p.fns, p.m.calls

    def loop() -> None:
        for i in range(calls):
            fns[i % len(fns)]()

    loop()
    torch.cuda.synchronize()
    reps = _reps(budget_s, timed_ms(loop), min_reps, max_reps)
    times = [timed_ms(loop) for _ in range(reps)]
    p.m.eager_reps = reps
    p.m.samples["eager_ms"] = times
    p.m.eager_us = _median(times) * 1e3 / calls


def measure(fns: Sequence[Runner], ref: torch.Tensor, *, budget_s: float = 0.25,
            max_graph_ms: float = 60.0, min_reps: int = 3, max_reps: int = 100,
            graph: bool = True) -> Measurement:
    """Warm up, check, and time ``fns`` (one runner per rotated input set) on their own."""
    p = prepare(fns, ref, max_graph_ms=max_graph_ms, graph=graph)
    time_replays([p], budget_s=budget_s, min_reps=min_reps, max_reps=max_reps)
    p.release()
    time_eager(p, budget_s=budget_s, min_reps=min_reps, max_reps=max_reps)
    return p.m
