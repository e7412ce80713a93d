"""tools/gpu_session.sh, which spends GPU time when it is wrong: it parses, and its usage
lines name exactly the steps it runs and the variables it reads (CPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import load_tool

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_session.sh"


def _header(text: str, key: str) -> set[str]:
    """Words of the `# key:` comment line and its indented continuation lines."""
    words: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"# {key}:"):
            words += line.split(":", 1)[1].replace(",", " ").split()
            for cont in lines[i + 1:]:
                if not re.match(r"#\s{4,}\S", cont):
                    break
                words += cont.lstrip("#").replace(",", " ").split()
    return set(words)


def test_usage_lists_exactly_the_steps_it_runs():
    text = SCRIPT.read_text()
    run = set(re.findall(r"^    ([a-z0-9-]+)\)", text, re.M))
    assert run, "no step labels found"
    assert _header(text, "steps") == run


def test_usage_lists_the_variables_it_reads():
    text = SCRIPT.read_text()
    read = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)(?::[-+])", text))
    documented = _header(text, "env")
    missing = read - {"OUT"} - documented  # OUT: set by the device tool
    assert read and not missing, f"undocumented: {sorted(missing)}"


def test_each_invocation_starts_with_empty_evidence_and_reports():
    """A warm device keeps /tmp between calls (entry T3): the script must empty the folders it
    packs into results.tgz before its first step, or a call returns an earlier call's records."""
    text = SCRIPT.read_text()
    first_step = text.index("for step in")
    clear = re.search(r"^rm -rf (.+)$", text[:first_step], re.M)
    assert clear, "no rm -rf of the packed folders before the steps"
    assert {"/tmp/ev", "/tmp/bench", "/tmp/integrate-logs"} <= set(clear.group(1).split())
    pack = re.search(r"^pack\(\) \{ tar -czf .* -C /tmp ev bench ", text, re.M)
    assert pack, "pack() no longer packs ev and bench: update this test with it"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_parses():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("argv,named", [
    (["--cases", "bs1-N16-H8-L4096,no-such-case"], "--cases: not in suite micro: no-such-case"),
    (["--systems", "ours,nope"], "--systems: unknown nope"),
    (["--layout", "paged"], "--layout: expected one of contiguous, fragmented, runs16, runs64, runs256, got 'paged'"),
    (["--side-by-side", "ours,flashml"], "--side-by-side: unknown flashml"),
    (["--alone", "--side-by-side", "ours"], "--alone and --side-by-side: give one of them"),
])
def test_ab_bench_refuses_unknown_cases_and_systems_before_touching_the_gpu(monkeypatch, capsys, argv, named):
    """tools/ab_bench.py names what it does not know and exits 2, before any CUDA call
    (these run on the CPU machine, where a CUDA call would raise)."""
    pytest.importorskip("torch")
    mod = load_tool("ab_bench")
    monkeypatch.setattr("sys.argv", ["ab_bench.py", "--label", "x", *argv])
    assert mod.main() == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv,together", [
    (["--alone"], ()),
    (["--side-by-side", ""], ()),
    (["--side-by-side", "ours"], ("ours",)),
    ([], ("ours", "ours-make", "ours-sm120")),  # the bench's group
])
def test_ab_bench_alone_is_an_empty_side_by_side_group(monkeypatch, argv, together):
    """--alone is --side-by-side "": no interleaved group, every system timed alone."""
    torch = pytest.importorskip("torch")
    from kdtree_pipeline.bench import gate

    mod = load_tool("ab_bench")
    default = gate.SIDE_BY_SIDE
    monkeypatch.setattr(mod, "PEERS", {s: types.SimpleNamespace(check=lambda: None) for s in mod.PEERS})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=0))
    seen = []
    monkeypatch.setattr(gate, "run_case", lambda case, systems, *a, side_by_side: seen.append((case.name, systems, side_by_side)))
    monkeypatch.setattr("sys.argv", ["ab_bench.py", "--label", "x", "--cases", "bs1-N16-H8-L4096",
                                     "--systems", "ours,ours-sm120", *argv])
    assert mod.main() == 0
    assert seen == [("bs1-N16-H8-L4096", ("ours", "ours-sm120"), together)]
    assert gate.SIDE_BY_SIDE == default  # the tool passes its group; the bench's is untouched


@pytest.mark.parametrize("text", ["12", "12,0,1", "sm_120", "12,x", ""])
def test_ab_bench_sglang_capability_refuses_what_is_not_major_minor(text):
    mod = load_tool("ab_bench")
    with pytest.raises(ValueError, match=r"--sglang-capability: expected MAJOR,MINOR"):
        mod.parse_capability(text)


def test_ab_bench_sglang_capability_sets_what_the_block_choice_reads(monkeypatch):
    """The extend kernel's block choice reads its module's CUDA_CAPABILITY at each call: the
    tool sets that global, and the choice it prints is the one the module now makes."""
    mod = load_tool("ab_bench")
    fake = types.ModuleType(mod.EXTEND_MODULE)
    fake.CUDA_CAPABILITY = (9, 0)
    fake._get_block_sizes_for_extend_attention = lambda lq, lv: (512, 64, 512) + (
        (32, 32, 8) if fake.CUDA_CAPABILITY[0] == 12 else (32, 64, 8))
    monkeypatch.setitem(sys.modules, mod.EXTEND_MODULE, fake)
    assert mod.parse_capability("12,0") == (12, 0)
    assert mod.extend_blocks()[3:5] == (32, 64)
    assert mod.set_sglang_capability((12, 0)) == (9, 0)
    assert fake.CUDA_CAPABILITY == (12, 0) and mod.extend_blocks()[3:5] == (32, 32)


def _ab_rows(tmp_path, rows):
    """An ab-bench JSONL file of (label, case, system, us, status) rows."""
    import json

    f = tmp_path / "ab.jsonl"
    keys = ("label", "case", "system", "us", "status")
    f.write_text("".join(json.dumps(dict(zip(keys, r, strict=True))) + "\n" for r in rows))
    return f


def test_ab_table_ratios_to_the_first_label_and_skips_figures_not_taken(tmp_path, capsys):
    """tools/ab_table.py: each label's figures in run order, mean / the first label's mean; a
    figure whose process could not take it (an old-ABI library: status "missing") is "-" and
    does not enter the mean; ours-sm120 / ours per label; unknown labels are refused."""
    ab_table = load_tool("ab_table")
    f = _ab_rows(tmp_path, [
        ("a", "c1", "ours", 10.0, "ok"), ("a", "c1", "flashmla", 9.0, "ok"), ("a", "c1", "ours-sm120", 20.0, "ok"),
        ("b", "c1", "ours", 8.0, "ok"), ("b", "c1", "ours", 9.0, "ok"), ("b", "c1", "ours-sm120", 17.0, "ok"),
        ("a", "c2", "ours", None, "missing"), ("b", "c2", "ours", 5.0, "ok"),
    ])
    assert ab_table.main([str(f), "a,b", "--sm120-ratio"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| c1 | 10.0 | 8.0 / 9.0 | 9.0 | 0.850 |"
    assert out[3] == "| c2 | - | 5.0 | - | - |"
    assert "| c1 | 2.000 | 2.000 |" in out
    assert ab_table.main([str(f), "a,zz"]) == 2
    assert "zz" in capsys.readouterr().err


def test_ab_table_any_status_takes_a_diagnostic_builds_wrong_figures_and_marks_them(tmp_path, capsys):
    """tools/ab_table.py --any-status: a timing-only build's rows (status "wrong": its output is
    wrong by design) enter the table marked "*" and the mean; without the flag they are "-";
    a row with no figure stays out either way."""
    ab_table = load_tool("ab_table")
    f = _ab_rows(tmp_path, [("lib", "c1", "ours", 10.0, "ok"), ("diag", "c1", "ours", 8.0, "wrong"),
                            ("diag", "c2", "ours", None, "error"), ("lib", "c2", "ours", 4.0, "ok")])
    assert ab_table.main([str(f), "lib,diag"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "| c1 | 10.0 | - | - | - |"
    assert ab_table.main([str(f), "lib,diag", "--any-status", "--verdict", "1.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| c1 | 10.0 | 8.0* | - | 0.800 |"
    assert out[3] == "| c2 | 4.0 | - | - | - |"
    assert any(line.startswith("| c1 | -20.0%") for line in out)


def test_ab_table_verdict_pairs_rounds_and_needs_every_round(tmp_path, capsys):
    """tools/ab_table.py --verdict: round k of a label against round k of the first label; a gain
    or a loss only when every round moves by the threshold, noise otherwise; a threshold that is
    not positive is refused."""
    ab_table = load_tool("ab_table")
    figs = {"fast": ([100.0, 102.0], [97.0, 99.5]),    # -3.0%, -2.5%: a gain at 2%
            "mixed": ([100.0, 100.0], [96.0, 101.0]),  # -4.0%, +1.0%: noise
            "slow": ([100.0, 100.0], [103.0, 102.5])}  # a loss
    f = _ab_rows(tmp_path, [(lab, c, "ours", us, "ok")
                            for k in range(2) for c, (a, b) in figs.items() for lab, us in (("a", a[k]), ("b", b[k]))])
    assert ab_table.main([str(f), "a,b", "--verdict", "2"]) == 0
    out = capsys.readouterr().out
    assert "| fast | -3.0% / -2.5% gain |" in out
    assert "| mixed | -4.0% / +1.0% noise |" in out
    assert "| slow | +3.0% / +2.5% loss |" in out
    assert "b: 1 gains (fast), 1 losses (slow), 1 within 2.0% in some round (ours)" in out
    assert ab_table.main([str(f), "a,b", "--verdict", "0"]) == 2
    assert "--verdict" in capsys.readouterr().err


def test_build_variant_takes_a_revision_from_git(tmp_path, capsys):
    """tools/build_variant.py --rev: csrc/ of that commit, read from git (not the working tree),
    byte for byte; a rev git cannot resolve, or --rev with --root, is refused with exit 2."""
    import git

    bv = load_tool("build_variant")
    root = Path(__file__).resolve().parents[1]
    repo = git.Repo(root)
    sha = bv.extract_csrc(root, "HEAD", tmp_path)
    assert sha == repo.head.commit.hexsha
    want = {b.path: b.data_stream.read() for b in (repo.head.commit.tree / "csrc").traverse() if b.type == "blob"}
    got = {p.relative_to(tmp_path).as_posix(): p.read_bytes() for p in (tmp_path / "csrc").rglob("*") if p.is_file()}
    assert got == want and "csrc/kdtree_verify.cu" in got
    assert bv.main([str(tmp_path / "v"), "--rev", "HEAD", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"--rev HEAD is {sha}" in out and "build-variant-" in out.splitlines()[-1]
    assert bv.main([str(tmp_path / "v"), "--rev", "no-such-branch-xyz"]) == 2
    assert "'no-such-branch-xyz' is not a commit" in capsys.readouterr().err
    assert bv.main([str(tmp_path / "v"), "--rev", "HEAD", "--root", str(root)]) == 2
    assert "--rev and --root" in capsys.readouterr().err


def test_build_variant_compiles_the_named_tree_with_the_extra_flags(tmp_path, capsys):
    """tools/build_variant.py: the nvcc command takes csrc/ of --root, the gate's flags, then the
    flags after --, and writes into the folder named; a --root without csrc/ is refused."""
    bv = load_tool("build_variant")
    root = Path(__file__).resolve().parents[1]
    assert bv.main([str(tmp_path / "v"), "--root", str(root), "--dry-run", "--", "-DKDTREE_FIXUP=0"]) == 0
    out = capsys.readouterr().out
    cmd = out.splitlines()[-1].split()
    # nvcc runs in the tree, which names its sources through /proc/self/cwd (kernel.build)
    assert cmd[:2] == ["cd", str(root)] and "nvcc" in cmd and "/proc/self/cwd/csrc/kdtree_verify.cu" in cmd
    assert cmd.index("-DKDTREE_FIXUP=0") > cmd.index("-O3")
    assert cmd[cmd.index("-I") + 1] == "/proc/self/cwd/csrc"
    assert cmd[cmd.index("-o") + 1] == str(tmp_path / "v" / "libkdtree_verify.so")
    assert bv.main([str(tmp_path / "v"), "--root", str(tmp_path)]) == 2
    assert "--root" in capsys.readouterr().err


def test_partials_precision_simulates_the_merge_and_scores_it_with_the_oracle(capsys):
    """tools/partials_precision.py: with one split the bf16 and fp32 partials give the same
    output (a bf16 value rounds to itself); with several, both pass the oracle's limits on its
    random data and the bf16 one is no closer to the reference; bad --cases are refused."""
    pp = load_tool("partials_precision")
    one = pp.simulate(4, 2, 200, 1, seed=0)
    assert one["fp32 partials"].max_abs == one["bf16 partials"].max_abs
    many = pp.simulate(4, 2, 3000, 8, seed=0)
    assert many["fp32 partials"].passed and many["bf16 partials"].passed
    assert many["bf16 partials"].cos_diff >= many["fp32 partials"].cos_diff * 0.99
    assert pp.split_bounds(300, 2) == [(0, 160), (160, 300)]
    assert pp.split_bounds(100, 2) == [(0, 100)]  # ceil(100 / 128) = 1 split, as on the device
    assert pp.main(["--cases", "4,2,x,1"]) == 2
    assert pp.main(["--cases", "4,2,100"]) == 2
    assert "--cases" in capsys.readouterr().err
