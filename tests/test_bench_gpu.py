"""GPU parts of the bench: timing, ceilings, and every importable peer on a small case.

Skipped without CUDA (the simulated-CUDA tests in test_bench_gate.py cover the
control flow on the CPU); on the H200 these check the adapters' calls before
the bench gate spends its budget.
"""

from __future__ import annotations

import pytest
import torch

from kdtree_pipeline.bench import data, roofline, timing
from kdtree_pipeline.bench.peers import PEERS, PeerUnsupported
from kdtree_pipeline.bench.suites import Case
from kdtree_pipeline.oracle import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_timing_replay_and_eager_and_unwritten_output():
    a = torch.randn((512, 512), device="cuda")
    ref = a @ a
    good = torch.empty_like(ref)

    def right():
        return torch.matmul(a, a, out=good)

    m = timing.measure([right], ref, budget_s=0.02)
    assert m.replay_us > 0 and m.eager_us > 0 and m.graph_error is None and m.correct
    stale = torch.full_like(ref, float("nan"))
    m = timing.measure([lambda: stale], ref, budget_s=0.02)
    assert not m.correct and m.check_eager["nonfinite"] > 0


def test_uncapturable_runner_keeps_its_eager_figure():
    x = torch.randn(1000, device="cuda")

    def syncs():
        x.sum().item()  # a host read: not allowed while capturing
        return x

    m = timing.measure([syncs], x, budget_s=0.02)
    assert m.replay_us is None and m.graph_error and m.eager_us > 0 and m.correct


def test_ceilings_are_plausible():
    ce = roofline.measure(copy_bytes=1 << 28, matmul_n=4096, reps=3)
    assert 1e11 < ce.copy_bytes_per_s < 2e13 and 1e12 < ce.matmul_flops_per_s < 5e15


@pytest.mark.parametrize("name", list(PEERS))
def test_peer_matches_reference(name):
    peer = PEERS[name]
    err = peer.check()
    if err:
        pytest.skip(f"{name} not importable: {err}")
    case = Case(2, 16, 8, 300)
    sets = data.build_sets(case, 2, "cuda", seed=1)
    for mask in peer.masks(case.masks):
        ref = reference.verify_attention_ref(*sets[0].batch(mask).ref_args())[0]
        try:
            fns = [peer.prepare(s.batch(mask)) for s in sets]
        except PeerUnsupported as e:
            pytest.skip(str(e))
        m = timing.measure(fns, ref, budget_s=0.02)
        assert m.correct, (mask, m.check_eager, m.check_replay)
        assert m.eager_us > 0
        if name == "ours":
            assert m.replay_us is not None, m.graph_error
