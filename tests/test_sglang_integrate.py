"""The integrate gate's host side on CPU: refusal without CUDA, entry point, masks, comparison."""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch

from kdtree_pipeline import integrate
from kdtree_pipeline.evidence import load_record
from kdtree_pipeline.integrate import Case


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gate_fails_with_one_clear_sentence_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    rc = integrate.main(["--out", str(tmp_path / "out")])
    assert rc == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["integrate: FAIL: the integrate gate needs a CUDA GPU and torch sees none "
                   "(torch.cuda.is_available() is False)"]
    rec = load_record(tmp_path / "integrate.json")
    assert rec["gate"] == "integrate" and rec["passed"] is False and "CUDA GPU" in rec["reason"]
    assert not (tmp_path / "out").exists()


def test_entry_point_dist_info_is_discoverable(tmp_path, monkeypatch):
    monkeypatch.setattr(integrate.importlib.metadata, "entry_points", lambda group: [])
    how, path = integrate.ensure_entry_point(tmp_path)
    assert how == "dist-info" and path == tmp_path
    eps = [ep for d in importlib.metadata.distributions(path=[str(tmp_path)]) for ep in d.entry_points]
    assert [(ep.group, ep.name, ep.value) for ep in eps] == [
        ("sglang.srt.plugins", "kdtree_verify", "kdtree_engine.sglang.plugin:load")]


def test_entry_point_already_installed_is_used_as_is(tmp_path):
    if not any(ep.name == "kdtree_verify" for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        pytest.fail("the package is not installed (pip install -e .): its entry point is not discoverable")
    assert integrate.ensure_entry_point(tmp_path) == ("installed", None)
    assert list(tmp_path.iterdir()) == []


def _case(mask: str, dtype: str = "bool", n: int = 6, prefix=(3, 0)) -> Case:
    return Case("t", 4, n, tuple(prefix), mask, dtype, "shuffled_pages")


def test_chain_mask_is_sglangs_full_mask_of_a_causal_chain():
    c = _case("chain")
    m = integrate.full_mask(c, 0, "cpu")
    assert m.dtype == torch.bool and m.numel() == sum(c.n * (L + c.n) for L in c.prefix_lens)
    first = m[: c.n * (3 + c.n)].view(c.n, 3 + c.n)
    assert first[:, :3].all()
    assert torch.equal(first[:, 3:], torch.tril(torch.ones(c.n, c.n, dtype=torch.bool)))


def test_tree_mask_rows_see_exactly_root_ancestors_and_self():
    c = _case("tree", "uint8", n=12, prefix=(5,))
    parents = integrate.tree_parents(c, 7)
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert parents != [i - 1 for i in range(c.n)], "seeded tree degenerated to a chain"
    m = integrate.full_mask(c, 7, "cpu")
    assert m.dtype == torch.uint8
    block = m.view(c.n, 5 + c.n)[:, 5:].bool()
    for i in range(c.n):
        seen, j = set(), i
        while j >= 0:
            seen.add(j)
            j = parents[j]
        assert set(torch.nonzero(block[i]).flatten().tolist()) == seen


def _result(out, sha="a", saved=True, us=10.0):
    return {"out": out, "pool_sha256": sha, "draft_saved": saved, "us": us}


def test_compare_case_accepts_bf16_rounding_and_rejects_real_differences():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(32, 1024, generator=g)
    off = ref.to(torch.bfloat16)
    on = (ref * (1 + 4e-3 * torch.randn(32, 1024, generator=g))).to(torch.bfloat16)
    good = integrate.compare_case(_result(off, us=100.0), _result(on, us=4.0))
    assert good["ok"] and good["problems"] == [] and good["speedup"] == pytest.approx(25.0)
    bad = on.clone()
    bad[3, 7] += 0.5
    r = integrate.compare_case(_result(off), _result(bad))
    assert not r["ok"] and "outputs differ" in r["problems"][0]
    r = integrate.compare_case(_result(off), _result(on, sha="b"))
    assert r["problems"] == ["KV pool bytes differ after the call"]
    r = integrate.compare_case(_result(off, saved=False), _result(on))
    assert r["problems"] == ["off: the drafts' KV is not in the pool after the call"]
    nan = on.clone()
    nan[0, 0] = float("nan")
    assert not integrate.compare_case(_result(off), _result(nan))["ok"]


def _write_run(d, hooked, cases, kit_ok=True):
    d.mkdir()
    summary = {"hooked": hooked, "standins": {}, "plugin": {"reason": "x"}, "cases": {}, "kit": {
        "kit-chain-n4": {"ok": kit_ok, "error": None if kit_ok else "AssertionError: boom",
                         "kernel_calls": 2 if hooked else 0}}}
    for name, (res, info) in cases.items():
        torch.save(res, d / f"{name}.pt")
        summary["cases"][name] = info
    (d / "summary.json").write_text(json.dumps(summary))


def test_compare_runs_requires_the_steps_later_calls_to_repeat_the_first(tmp_path):
    """With the plugin on, the step's later calls read the step plan the first one made: their
    output must be the first call's, bit for bit, and a plan made must have been read."""
    out = torch.ones(4, 8, dtype=torch.bfloat16)
    _write_run(tmp_path / "off", False, {"c": (_result(out, us=50.0), {"us": 50.0})})
    good = {"us": 10.0, "kernel_calls": 3, "fallbacks": {}, "repeat_equal": True, "plan_calls": {"made": 1, "read": 2}}
    _write_run(tmp_path / "on", True, {"c": (_result(out), good)})
    assert integrate.compare_runs(tmp_path / "off", tmp_path / "on")[0]
    _write_run(tmp_path / "on2", True, {"c": (_result(out), {**good, "repeat_equal": False})})
    ok, problems, _ = integrate.compare_runs(tmp_path / "off", tmp_path / "on2")
    assert not ok and "differs from the first" in problems[0]
    _write_run(tmp_path / "on3", True, {"c": (_result(out), {**good, "plan_calls": {"made": 1, "read": 0}})})
    ok, problems, _ = integrate.compare_runs(tmp_path / "off", tmp_path / "on3")
    assert not ok and "made but no later call read it" in problems[0]


def test_compare_runs_requires_the_kernel_on_and_the_hook_off(tmp_path):
    out = torch.ones(4, 8, dtype=torch.bfloat16)
    _write_run(tmp_path / "off", False, {"c": (_result(out, us=50.0), {"us": 50.0})})
    _write_run(tmp_path / "on", True, {"c": (_result(out), {"us": 10.0, "kernel_calls": 1, "fallbacks": {}})})
    ok, problems, details = integrate.compare_runs(tmp_path / "off", tmp_path / "on")
    assert ok and problems == [] and details["cases"]["c"]["speedup"] == pytest.approx(5.0)

    _write_run(tmp_path / "on2", True, {"c": (_result(out), {"us": 10.0, "kernel_calls": 0,
                                                              "fallbacks": {"fp8 KV cache": 1}})})
    ok, problems, _ = integrate.compare_runs(tmp_path / "off", tmp_path / "on2")
    assert not ok and "not served by the kernel" in problems[0]

    _write_run(tmp_path / "off2", True, {"c": (_result(out), {"us": 50.0})}, kit_ok=False)
    ok, problems, _ = integrate.compare_runs(tmp_path / "off2", tmp_path / "on")
    assert not ok
    assert any("the hook is installed" in p for p in problems)
    assert any("kit check kit-chain-n4 failed" in p for p in problems)


def test_kit_graph_cases_compare_plugin_on_with_sglangs_own_graph_path(tmp_path):
    """SGLang's own reference check may fail in both modes; what counts is on == off."""
    out = torch.ones(4, 8, dtype=torch.bfloat16)
    x = [torch.randn(6, 32), torch.randn(6, 32)]
    for mode, hooked, tensors, calls in (("off", False, x, 0), ("on", True, [t + 1e-4 for t in x], 3),
                                         ("onbad", True, [t + 1.0 for t in x], 3)):
        _write_run(tmp_path / mode, hooked, {"c": (_result(out), {"us": 10.0, "kernel_calls": 1 if hooked else 0,
                                                                  "fallbacks": {}})})
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        summary["kit"] = {"g": {"ok": False, "error": "Tensor-likes are not close!", "cuda_graph": True,
                                "kernel_calls": calls, "checks": [{"ok": False, "error": "x"}]}}
        (tmp_path / mode / "summary.json").write_text(json.dumps(summary))
        torch.save(tensors, tmp_path / mode / "g-kit.pt")
    ok, problems, details = integrate.compare_runs(tmp_path / "off", tmp_path / "on")
    assert ok, problems
    assert "fails with the plugin off too" in details["kit"]["on"]["g"]["note"]
    ok, problems, _ = integrate.compare_runs(tmp_path / "off", tmp_path / "onbad")
    assert not ok and any("differs from plugin-off" in p for p in problems)

    # a kit check that passed with the plugin on but never reached the kernel proves nothing
    _write_run(tmp_path / "on3", True, {"c": (_result(out), {"us": 10.0, "kernel_calls": 1, "fallbacks": {}})})
    summary = json.loads((tmp_path / "on3" / "summary.json").read_text())
    summary["kit"]["kit-chain-n4"]["kernel_calls"] = 0
    (tmp_path / "on3" / "summary.json").write_text(json.dumps(summary))
    ok, problems, _ = integrate.compare_runs(tmp_path / "off", tmp_path / "on3")
    assert not ok and any("ran without the kernel" in p for p in problems)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quick_integrate_gate_passes_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    rc = integrate.main(["--quick", "--out", str(tmp_path / "out")])
    rec = load_record(tmp_path / "integrate-quick.json")
    assert rc == 0, rec["reason"]
    assert rec["passed"] and rec["metrics"]["cases_ok"] == rec["metrics"]["cases"] >= 3


def test_sgl_kernel_standin_serves_import_time_names_and_refuses_real_use():
    """Run in a child process: the stand-in must not leak into this test session."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import importlib.util, sys
        from kdtree_pipeline.testing import standins as _standins
        assert importlib.util.find_spec("sgl_kernel") is None, "a real sgl_kernel is installed"
        assert _standins.install_sgl_kernel_standin() is True
        from sgl_kernel.utils import is_arch_support_pdl
        from sgl_kernel import some_kernel
        from sgl_kernel.elementwise import fused_add_rmsnorm
        assert callable(is_arch_support_pdl) and is_arch_support_pdl.__module__.startswith("kdtree_pipeline")
        @some_kernel
        def f():
            return 7
        assert f() == 7
        try:
            fused_add_rmsnorm(1, 2)
        except _standins.StandInError as e:
            assert "sgl_kernel.elementwise.fused_add_rmsnorm" in str(e)
            print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
