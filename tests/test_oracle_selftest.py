"""The oracle-selftest gate (CPU): the fp32 reference against the float64 loop and the
golden vectors, and what a missing or wrong golden file does to its verdict."""

from __future__ import annotations

import hashlib

import torch

from kdtree_pipeline.oracle import selftest


def test_the_reference_agrees_with_the_loop_and_the_golden_vectors():
    passed, metrics, rows = selftest.run()
    assert passed and metrics["passed_cases"] == metrics["cases"] == len(selftest.CASES) + len(selftest.GOLDEN_CASES)
    assert [r["check"] for r in rows] == ["ref-vs-loop"] * len(selftest.CASES) + ["golden"] * 2
    assert metrics["golden_sha256"] == hashlib.sha256(selftest.GOLDEN.read_bytes()).hexdigest()
    assert 0 < metrics["worst_max_abs"] < selftest.SELF_ATOL


def test_a_missing_or_wrong_golden_file_fails_the_gate(tmp_path, monkeypatch):
    monkeypatch.setattr(selftest, "GOLDEN", tmp_path / "golden.pt")
    passed, metrics, rows = selftest.run()
    assert not passed and metrics["golden_sha256"] is None
    assert rows[-1] == {"check": "golden", "case": str(tmp_path / "golden.pt"), "passed": False,
                        "error": "golden file missing"}
    data = torch.load(selftest.write_golden(tmp_path / "golden.pt"), weights_only=True)
    assert selftest.run()[0]  # the vectors written from the loop pass
    data["ragged-with-empty"]["out"][0, 0, 0] += 1e-2
    torch.save(data, tmp_path / "golden.pt")
    passed, metrics, rows = selftest.run()
    assert not passed and [r["case"] for r in rows if not r["passed"]] == ["ragged-with-empty"]
    assert metrics["passed_cases"] == metrics["cases"] - 1
