"""Gate arguments are checked before any GPU or server is looked for: the pure
check itself, the module entry point, the nox session on this (CPU) machine,
and the build gate's headline when cuobjdump is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kdtree_pipeline import __main__ as entry
from kdtree_pipeline import build
from kdtree_pipeline.bench import suites

PROJECT = Path(__file__).resolve().parents[1]


def test_bad_suite_system_and_budget_are_named():
    assert entry.check_args("bench", ["--suite", "nope"]) == (
        f"--suite: expected one of {', '.join(suites.SUITES)}, got 'nope'")
    assert "unknown system(s) bogus" in entry.check_args("bench", ["--systems", "ours,bogus"])
    assert "--budget-s: expected a positive number of seconds, got -1.0" == entry.check_args(
        "bench", ["--budget-s", "-1"])
    assert "unrecognized arguments: --frobnicate" in entry.check_args("bench", ["--frobnicate"])
    assert "unknown gate 'benhc'" in entry.check_args("benhc", [])


def test_every_suite_and_system_of_the_suites_module_is_accepted(monkeypatch):
    for name in suites.SUITES:
        assert entry.check_args("bench", ["--suite", name]) is None
    assert entry.check_args("bench", ["--systems", ",".join(suites.SYSTEMS)]) is None
    assert entry.check_args("bench", ["--help"]) is None  # the gate prints its help itself
    # names are read from the suites module: a new one is accepted without touching the check
    monkeypatch.setitem(suites.SUITES, "brand-new", suites.SUITES["micro"])
    monkeypatch.setattr(suites, "SYSTEMS", (*suites.SYSTEMS, "ours-next"))
    assert entry.check_args("bench", ["--suite", "brand-new", "--systems", "ours-next"]) is None


def test_module_entry_point_checks_before_anything(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kdtree_pipeline", "bench", "--suite", "nope"],
                         env={**os.environ, "KDTREE_EVIDENCE_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "kdtree bench: --suite: expected one of" in out.stderr and "got 'nope'" in out.stderr
    assert not list(tmp_path.iterdir())  # no evidence written, no GPU looked for


def test_nox_bench_names_the_bad_suite_before_the_gpu_check():
    out = subprocess.run([sys.executable, "-m", "nox", "--no-venv", "-s", "bench", "--", "--suite", "nope"],
                         cwd=PROJECT, capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "gate bench: --suite: expected one of" in text and "got 'nope'" in text
    assert "needs a CUDA GPU" not in text


def test_build_headline_says_when_sass_is_not_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path))
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"\0" * 16)
    kernels = {"sm_90a": {"k": {"registers": 100, "spill_stores": 0, "spill_loads": 0}}}

    def fake_build(archs, out, force, sass):
        return build.BuildResult(lib, False, ["sm_90a"], [], "13.0", kernels, sass)

    for sass, expect in (({}, "; SASS not counted (no cuobjdump)"),
                         ({"sm_90a": {"HGMMA": 7, "HMMA": 1}}, "; SASS MMA sm_90a=8")):
        monkeypatch.setattr(build, "build", lambda a, o, f, s=sass: fake_build(a, o, f, s))
        assert build.main([]) == 0
        headline = json.loads((tmp_path / "build.json").read_text())["headline"]
        assert headline.endswith(expect), headline


def test_good_arguments_still_run(capsys):
    assert entry.main(["bench", "--suite", "micro", "--list"]) == 0
    assert f"{len(suites.SUITES['micro'].cases)} cases" in capsys.readouterr().out
