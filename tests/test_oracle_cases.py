"""The oracle's "rescale" cases really move the running maximum late (CPU)."""

from __future__ import annotations

import pytest
import torch

from kdtree_pipeline.oracle import gate, workloads


def _late_jumps(b: workloads.Batch, tile: int = 64, threshold: float = 8.0) -> int:
    """Tiles after the first where some row's tile maximum (log2 units) passes its
    running maximum by more than `threshold`: where the kernel has to re-agree maxima."""
    k = b.kv_buffer.view(b.kv_buffer.shape[0], -1)[b.kv_indices.long()].float()
    s = (b.q.float().flatten(0, 1) @ k.T) * b.sm_scale * 1.4426950408889634
    tm = torch.stack([s[:, i:i + tile].amax(dim=1) for i in range(0, s.shape[1], tile)], dim=1)
    run = torch.cummax(tm, dim=1).values
    return int((tm[:, 1:] > run[:, :-1] + threshold).any(dim=0).sum())


@pytest.mark.parametrize("name", ["ramp-L4095-splits1", "spike-L4095-splits1-H64"])
def test_rescale_cases_jump_late_and_keep_v(name):
    case = next(c for c in gate.cases() if c.name == name)
    b = workloads.make_batch(case.prefix_lens, case.n_drafts, case.heads, seed=0)
    plain = _late_jumps(b)
    v_before = b.kv_buffer[..., :512].clone()
    gate.shape_keys(b, case.keys)
    assert plain == 0  # random keys: the maximum settles in the first tile
    assert _late_jumps(b) >= (3 if case.keys == "ramp" else 1)
    if case.keys == "ramp":
        assert torch.allclose(b.kv_buffer[..., :512], v_before, rtol=0, atol=0, equal_nan=True)  # V unchanged


def test_unknown_key_shape_is_refused():
    b = workloads.make_batch([70], [3], 2, seed=0)
    with pytest.raises(ValueError, match="keys"):
        gate.shape_keys(b, "sawtooth")
