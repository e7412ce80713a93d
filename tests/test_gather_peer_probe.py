"""tools/gather_peer_probe.py (docs/kernel-notes.md, entry AG1): the sparse kernel's inputs cut
from a verify batch, the spot check of its output, and the arguments it refuses before it
spends GPU time (CPU)."""

from __future__ import annotations

import pytest
import torch

from conftest import load_tool
from kdtree_pipeline.oracle import workloads

gp = load_tool("gather_peer_probe")


def _prefix_softmax(q, kv, idx, scale):
    outs = []
    for b in range(q.shape[0]):
        k = kv[idx[b, 0].long(), 0].float()
        outs.append(torch.softmax((q[b].float() @ k.T) * scale, dim=-1) @ k[:, :512])
    return torch.stack(outs)


def test_sparse_inputs_give_each_request_its_own_rows_and_slots():
    b = workloads.make_batch([256, 256, 256], gp.N_DRAFTS, gp.HEADS, tree="chain", layout="fragmented", seed=3)
    q, kv, idx = gp.sparse_inputs(b, 256)
    assert q.shape == (3, gp.N_DRAFTS * gp.HEADS, 576) and q.is_contiguous()
    assert idx.shape == (3, 1, 256) and idx.dtype == torch.int32
    assert kv is b.kv_buffer
    for r in range(3):  # request r's query rows and its prefix slots, in SGLang's order
        lo, hi = int(b.qo_indptr[r]), int(b.qo_indptr[r + 1])
        assert torch.equal(q[r], b.q[lo:hi].reshape(-1, 576))
        k0, k1 = int(b.kv_indptr[r]), int(b.kv_indptr[r + 1])
        assert torch.equal(idx[r, 0].long(), b.kv_indices[k0:k1].long())
    assert len(set(idx.flatten().tolist())) == 3 * 256  # fragmented: no slot shared between requests


def test_the_spot_check_passes_the_softmax_and_catches_a_wrong_output():
    b = workloads.make_batch([128, 128], gp.N_DRAFTS, gp.HEADS, tree="chain", layout="fragmented", seed=1)
    q, kv, idx = gp.sparse_inputs(b, 128)
    out = _prefix_softmax(q, kv, idx, b.sm_scale).to(torch.bfloat16)
    assert gp.sparse_ref_rel_l2(out, q, kv, idx, b.sm_scale) < 5e-3
    assert gp.sparse_ref_rel_l2(out.flip(0), q, kv, idx, b.sm_scale) > 0.5  # another request's output
    assert gp.sparse_ref_rel_l2(out * 1.1, q, kv, idx, b.sm_scale) > 0.05


def test_cases_are_parsed_and_bad_ones_named():
    assert gp.parse_cases("264x2048,66X8192") == [(264, 2048), (66, 8192)]
    with pytest.raises(ValueError, match="multiple of 128"):
        gp.parse_cases("264x2000")
    with pytest.raises(ValueError, match="expected BSxL"):
        gp.parse_cases("0x128")


@pytest.mark.parametrize("argv, says", [
    (["--cases", "264x100"], "--cases: L must be a multiple of 128"),
    (["--cases", "abc"], "--cases: expected BSxL"),
    (["--cases", ","], "--cases: no case given"),
    (["--layouts", "sideways"], "--layouts: expected names of"),
    (["--budget", "0"], "--budget: expected seconds > 0, got 0.0"),
    (["--label", " "], "--label: expected a name for the library"),
])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    assert gp.main(argv) == 2
    assert says in capsys.readouterr().err
