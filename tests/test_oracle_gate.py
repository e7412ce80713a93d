"""The oracle gate's main on a CPU: its refusals, --list, the no-GPU record, and how it sums
up the cases into its record and report (the kernel, the library and the GPU stood in for)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from kdtree_engine.kernel import library
from kdtree_engine.kernel.op import TARGETS
from kdtree_pipeline.oracle import gate


@pytest.fixture
def ev(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    return tmp_path


def test_unknown_group_or_target_is_named_and_writes_nothing(ev, capsys):
    groups = sorted({c.group for c in gate.cases()})
    assert gate.main(["--groups", "edge,bogus"]) == 2
    assert capsys.readouterr().err == f"oracle: unknown group(s) ['bogus']; expected some of {groups}\n"
    assert gate.main(["--targets", "native,sm_99"]) == 2
    assert capsys.readouterr().err == (f"oracle: --targets: unknown target(s) ['sm_99']; expected some of "
                                       f"{list(TARGETS)}\n")
    assert gate.main(["--targets", " , "]) == 2
    assert "unknown target(s) ' , '" in capsys.readouterr().err
    assert not list(ev.iterdir())


def test_list_prints_the_chosen_groups(ev, capsys):
    assert gate.main(["--groups", "edge,rescale", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    chosen = [c for c in gate.cases() if c.group in ("edge", "rescale")]
    assert out[-1] == f"{len(chosen)} cases" and len(out) == len(chosen) + 1
    assert out[0] == f"{chosen[0].group:9s} {chosen[0].name}"
    assert not list(ev.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_cuda_it_fails_with_a_record(ev, capsys):
    assert gate.main(["--groups", "edge"]) == 1
    rec = json.loads((ev / "oracle.json").read_text())
    assert rec["passed"] is False and rec["headline"] == "not run: no CUDA GPU"
    assert "needs a CUDA GPU" in capsys.readouterr().err


class FakeLibrary:
    archs = ["sm_90a"]

    def __init__(self, refuse: str | None = None):
        self.refuse = refuse

    def kernel_name(self, device, target):
        if self.refuse is not None and target == TARGETS[self.refuse]:
            raise RuntimeError("no sm_120 emulation below CC 9.0")
        return f"kernel-{target}"


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as the gate asks, with results from a stand-in run_case: the
    case "one-row" crashes on the sm_120 target, every other case passes with errors that
    grow with its index."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(gate.evidence, "device_info", lambda: None)
    monkeypatch.setattr(library, "load", lambda: FakeLibrary())
    index = {c.name: i for i, c in enumerate(gate.cases())}

    def run_case(c, seed, device, target="native"):
        if c.name == "one-row" and target == "sm_120":
            raise RuntimeError("kernel launch failed")
        i = index[c.name]
        return {"target": target, "group": c.group, "case": c.name, "rows": 8, "passed": True,
                "max_abs": 1e-3 * (i + 1), "cos_diff": 1e-6 * (i + 1), "lse_max_abs": 1e-4 if i % 2 else None,
                "seed": seed}

    monkeypatch.setattr(gate, "run_case", run_case)
    return types.SimpleNamespace(index=index)


def test_results_are_summed_up_per_target_and_group(ev, fake_gpu, capsys):
    assert gate.main(["--groups", "edge,rescale", "--targets", "native,sm_120", "--seed", "5"]) == 1
    out = capsys.readouterr().out
    rec = json.loads((ev / "oracle.json").read_text())
    chosen = [c for c in gate.cases() if c.group in ("edge", "rescale")]
    n = len(chosen)
    assert rec["passed"] is False
    assert rec["reason"] == "1 case(s) failed: sm_120/edge/one-row"
    m = rec["metrics"]
    assert m["cases"] == 2 * n and m["failed"] == 1
    assert m["targets"] == {"native": {"kernel": "kernel-0", "cases": n, "passed": n},
                            "sm_120": {"kernel": f"kernel-{TARGETS['sm_120']}", "cases": n, "passed": n - 1}}
    assert m["library_archs"] == ["sm_90a"] and set(m["tolerance"]) == {"atol", "rtol", "cos_diff", "lse_atol"}
    edge = [c for c in chosen if c.group == "edge"]
    worst_edge = max(1e-3 * (fake_gpu.index[c.name] + 1) for c in edge)
    assert m["worst_per_group"]["native/edge"]["max_abs"] == pytest.approx(worst_edge)
    assert m["worst_per_group"]["native/edge"]["failed"] == 0
    assert m["worst_per_group"]["sm_120/edge"] == {"cases": len(edge), "failed": 1, "max_abs": float("inf"),
                                                   "cos_diff": float("inf"), "lse_max_abs": float("inf")}
    assert sorted(m["worst_per_group"]) == ["native/edge", "native/rescale", "sm_120/edge", "sm_120/rescale"]
    assert rec["headline"] == (f"{n}/{n} native (kernel-0); {n - 1}/{n} sm_120 (kernel-{TARGETS['sm_120']}) "
                               f"within bf16 tolerance; worst |d| inf, cos_diff inf")
    rows = rec["details"]["rows"]
    assert [r["seed"] for r in rows if r["target"] == "native"] == list(range(5, 5 + n))
    crashed = next(r for r in rows if r["case"] == "one-row" and r["target"] == "sm_120")
    assert crashed == {"target": "sm_120", "group": "edge", "case": "one-row", "passed": False,
                       "error": "RuntimeError: kernel launch failed"}
    assert "oracle: target native: kernel-0\n" in out
    assert "  FAIL sm_120 edge      one-row                RuntimeError: kernel launch failed\n" in out
    first = chosen[0]
    i = fake_gpu.index[first.name]
    assert (f"  ok  native {first.group:9s} {first.name:22s} max|d|={1e-3 * (i + 1):.2e} "
            f"cos={1e-6 * (i + 1):.1e} lse={(1e-4 if i % 2 else 0):.1e}\n") in out
    assert "\noracle: FAIL: " + rec["headline"] in out
    assert f"  sm_120/edge {len(edge):4d} cases, 1 failed, worst |d| inf, cos inf, lse inf\n" in out


def test_one_target_names_groups_alone_and_passes(ev, fake_gpu, capsys):
    assert gate.main(["--groups", "rescale", "--targets", "native"]) == 0
    rec = json.loads((ev / "oracle.json").read_text())
    assert rec["passed"] is True and rec["reason"] is None
    assert list(rec["metrics"]["worst_per_group"]) == ["rescale"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("  rescale      4 cases, 0 failed, worst |d| ")


def test_a_library_that_cannot_load_or_lacks_a_target_fails_with_a_record(ev, fake_gpu, monkeypatch, capsys):
    def broken():
        raise OSError("libkdtree_verify.so: cannot open shared object file")

    monkeypatch.setattr(library, "load", broken)
    assert gate.main(["--groups", "edge", "--targets", "native"]) == 1
    rec = json.loads((ev / "oracle.json").read_text())
    assert rec["headline"] == "not run: no kernel library"
    assert rec["reason"] == "cannot load the kernel library: libkdtree_verify.so: cannot open shared object file"
    assert capsys.readouterr().err == f"oracle: FAILED: {rec['reason']}\n"
    monkeypatch.setattr(library, "load", lambda: FakeLibrary(refuse="sm_120"))
    assert gate.main(["--groups", "edge", "--targets", "native,sm_120"]) == 1
    rec = json.loads((ev / "oracle.json").read_text())
    assert rec["reason"] == "target sm_120: no sm_120 emulation below CC 9.0"
    assert rec["headline"] == f"not run: {rec['reason']}"
