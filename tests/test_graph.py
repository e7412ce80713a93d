"""CUDA-graph capacity checks (CPU) and capture/replay equality (GPU)."""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernel.op import VerifyArgumentError
from kdtree_pipeline.graph.capture import Capacity, check_fits
from kdtree_pipeline.oracle import workloads

CAP = Capacity(max_bs=4, max_n=8, max_prefix_tokens=4 * 100 + 4, num_heads=2, max_prefix_len=100)


def test_a_step_that_fits_is_accepted():
    """Accepted up to every limit at once (max_bs requests of max_prefix_len tokens and
    exactly max_n drafts), refused one past: the limits are not off by one."""
    assert check_fits(CAP, workloads.make_batch([100, 3, 0], 8, 2, seed=1)) is None
    full = workloads.make_batch([100] * 4, 8, 2, seed=1)
    assert full.custom_mask.numel() <= CAP.max_mask
    assert check_fits(CAP, full) is None
    with pytest.raises(VerifyArgumentError, match="a prefix of 101 tokens"):
        check_fits(CAP, workloads.make_batch([100] * 3 + [101], 8, 2, seed=1))


@pytest.mark.parametrize(
    "lens,n,heads,match",
    [
        ([1] * 5, 8, 2, "batch of 5 requests, captured for at most 4"),
        ([101], 8, 2, "a prefix of 101 tokens, captured for at most 100"),
        ([10, 10], 4, 2, r"drafts per request \[4\], captured for exactly 8"),
        ([10], 8, 4, "4 heads, captured for 2"),
    ],
)
def test_a_step_that_does_not_fit_is_refused(lens, n, heads, match):
    with pytest.raises(VerifyArgumentError, match=match):
        check_fits(CAP, workloads.make_batch(lens, n, heads, seed=2))


def test_total_prefix_counts_padding():
    cap = Capacity(max_bs=4, max_n=8, max_prefix_tokens=200, num_heads=2, max_prefix_len=100)
    check_fits(cap, workloads.make_batch([100, 97], 8, 2, seed=3))  # 197 + 2 padded = 199
    with pytest.raises(VerifyArgumentError, match="prefix tokens"):
        check_fits(cap, workloads.make_batch([100, 99], 8, 2, seed=3))  # 199 + 2 = 201


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_gate_small(tmp_path, monkeypatch):
    from kdtree_pipeline.graph import gate

    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    # a small capacity: the replay steps' fixed prefixes (up to 23000) are capped to it
    assert gate.main(["--max-prefix", "2048"]) == 0
