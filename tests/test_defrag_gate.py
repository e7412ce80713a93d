"""The defrag gate: fails with one clear sentence without a GPU; passes on one."""

from __future__ import annotations

import json

import pytest
import torch

from kdtree_pipeline import defrag as gate
from kdtree_pipeline.__main__ import main as dispatch
from kdtree_pipeline.evidence import load_record


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_gate_fails_without_gpu_and_writes_evidence(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    rc = dispatch(["defrag"])
    assert rc == 1
    rec = load_record(tmp_path / "defrag.json")
    assert rec["gate"] == "defrag" and rec["passed"] is False
    assert "CUDA GPU" in rec["reason"] and rec["reason"].count(".") <= 1
    assert "FAIL" in capsys.readouterr().out


def test_gate_rejects_bad_usage():
    with pytest.raises(SystemExit) as info:
        gate.main(["--layers", "many"])
    assert info.value.code == 2


def test_tree_mask_is_sglang_full_mask():
    g = torch.Generator().manual_seed(0)
    mask, indptr = gate.tree_mask([3, 0], 4, g)
    assert indptr.tolist() == [0, 4 * 7, 4 * 7 + 4 * 4]
    m0 = mask[: 4 * 7].view(4, 7)
    assert bool(m0[:, :3].all())  # every draft sees the whole prefix
    tree = m0[:, 3:]
    assert bool(tree.diagonal().all()) and not bool(tree.triu(1).any())  # self, ancestors only
    assert bool(tree[:, 0].all())  # the root is everyone's ancestor


def _stand_in_verify(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                     sm_scale, max_n, **_):
    """A plain torch tree-verify (fp32 math) standing in for the CUDA kernel on a CPU."""
    out = torch.empty((q.shape[0], q.shape[1], 512), dtype=torch.bfloat16)
    for b in range(qo_indptr.numel() - 1):
        q0, q1, k0, k1 = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_indptr[b]), int(kv_indptr[b + 1])
        n, L = q1 - q0, k1 - k0
        keys = torch.cat([kv_buffer[kv_indices[k0:k1].long(), 0], k_ext[q0:q1, 0]]).float()
        m = custom_mask[int(mask_indptr[b]) : int(mask_indptr[b]) + n * (L + n)].view(n, L + n)
        s = torch.einsum("thd,kd->thk", q[q0:q1].float(), keys) * sm_scale
        s = s.masked_fill(~m[:, None, :], float("-inf"))
        out[q0:q1] = torch.einsum("thk,kd->thd", s.softmax(-1), keys[:, :512]).to(torch.bfloat16)
    return out


def test_gate_checks_run_on_cpu_with_a_stand_in_kernel(monkeypatch):
    """The gate's own checks (pools, holders, verify before/after, penalty
    bookkeeping) on a CPU, with the kernel replaced by a torch stand-in."""
    import kdtree_engine.kernel.op as op

    monkeypatch.setattr(op, "verify_attention", _stand_in_verify)
    args = gate._parser().parse_args(["--pool-tokens", "6000", "--layers", "2", "--requests", "24",
                                      "--trials", "1", "--prefix", "512", "--drafts", "4", "--heads", "2",
                                      "--rounds", "1"])
    metrics, details = gate.run_checks(args, torch.device("cpu"))
    assert metrics["pools_checked"] == 4 and metrics["verify_identical"] is True
    assert len(details["verify"]) == 4 and all(v["identical"] for v in details["verify"])
    assert details["penalty"]["runs"] == {"contiguous": 1, "fragmented": details["penalty"]["runs"]["fragmented"],
                                          "defragmented": 1}
    assert details["penalty"]["runs"]["fragmented"] > 100
    assert details["penalty"]["fast_path_share"] == {"contiguous": None, "fragmented": None, "defragmented": None}
    assert metrics["defrag_bytes_moved"] == 512 * 2 * 576 * 2
    assert {t["strategy"] for t in details["trials"]} == {"runs", "compact"}


def test_gate_catches_a_kernel_that_sees_the_move(monkeypatch):
    """A verify whose output depends on the slot ids themselves must fail the check."""
    import kdtree_engine.kernel.op as op

    def leaky(q, *a, **k):
        return _stand_in_verify(q, *a, **k) + a[4].float().mean().to(torch.bfloat16)  # kv_indices leak

    monkeypatch.setattr(op, "verify_attention", leaky)
    args = gate._parser().parse_args(["--pool-tokens", "3000", "--layers", "1", "--requests", "4",
                                      "--trials", "1", "--prefix", "256", "--drafts", "2", "--heads", "1"])
    with pytest.raises(gate.GateCheckError, match="verify output changed"):
        gate.run_checks(args, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gate_passes_on_gpu_small(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    rc = gate.main(["--pool-tokens", "65536", "--layers", "2", "--requests", "16", "--trials", "1",
                    "--prefix", "16384", "--rounds", "2", "--max-penalty", "0.25"])
    rec = json.loads((tmp_path / "defrag.json").read_text())
    assert rc == 0, rec["reason"]
    assert rec["metrics"]["verify_identical"] is True
    assert rec["details"]["penalty"]["runs"]["defragmented"] == 1
    share = rec["details"]["penalty"]["fast_path_share"]
    if share["defragmented"] is not None:  # sm_90a: the defragmented request loads through TMA boxes only
        assert share["defragmented"] == 1.0 and share["fragmented"] < 0.01
