"""tools/build_fm_src.py and tools/fm_src_peer.py: FlashMLA built from its source as a bench peer,
and its timing-only variant without key loads (CPU: the source edits, the git reading, the
arguments refused before any GPU time; the build itself needs nvcc and FlashMLA's sources)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import git, load_tool

bf = load_tool("build_fm_src")
fp = load_tool("fm_src_peer")


def _fake_kernel(extra: str = "") -> str:
    """A splitkv_mla.cuh that holds each edited text as often as FlashMLA 9241ae3 does."""
    parts = ["// head\n"]
    for old, _, count in bf.NO_KV_LOADS:
        parts += [old, "    // between\n"] * count
    return "".join(parts) + extra


def _preprocess(text: str, defined: bool) -> str:
    """The lines the compiler sees with FM_NO_KV_LOADS defined or not (only that macro's blocks)."""
    out, stack = [], []
    for line in text.splitlines(keepends=True):
        s = line.strip()
        if s in ("#ifdef FM_NO_KV_LOADS", "#ifndef FM_NO_KV_LOADS"):
            stack.append(defined if s.startswith("#ifdef") else not defined)
        elif s == "#else" and stack:
            stack[-1] = not stack[-1]
        elif s == "#endif" and stack:
            stack.pop()
        elif all(stack):
            out.append(line)
    return "".join(out)


def test_without_the_switch_the_edited_kernel_is_flashmla_line_for_line():
    src = _fake_kernel()
    edited = bf.edit_no_kv_loads(src)
    assert edited != src
    assert _preprocess(edited, defined=False) == src


def test_with_the_switch_no_key_copy_is_issued_and_no_byte_count_is_awaited():
    seen = _preprocess(bf.edit_no_kv_loads(_fake_kernel()), defined=True)
    assert "cute::copy(tma_K" not in seen
    assert "arrive_and_expect_tx" not in seen
    assert seen.count("barrier->arrive();") == 2 and seen.count("barriers_K0[i].arrive();") == 1
    # both key buffers are zeroed before the CTA's first barrier, so the math runs on finite numbers
    zero = seen.index("k0[i] = make_uint4"), seen.index("k1[i] = make_uint4")
    assert max(zero) < seen.index("__syncthreads();")


@pytest.mark.parametrize("drop", range(len(bf.NO_KV_LOADS)))
def test_a_source_that_no_longer_holds_an_edited_text_is_refused_by_name(drop):
    old = bf.NO_KV_LOADS[drop][0]
    src = _fake_kernel().replace(old, "", 1)
    with pytest.raises(bf.SourceChanged, match=re.escape(old.strip()[:40])):
        bf.edit_no_kv_loads(src)


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    git(path, "config", "user.email", "t@t")
    git(path, "config", "user.name", "t")
    return path


def _commit_all(repo: Path) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "c")
    return git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def sources(tmp_path):
    """A CUTLASS repository and a FlashMLA one whose csrc/cutlass pins its commit."""
    cu = _repo(tmp_path / "cutlass")
    (cu / "include" / "cute").mkdir(parents=True)
    (cu / "include" / "cute" / "tensor.hpp").write_text("// cute\n")
    (cu / "README.md").write_text("not extracted\n")
    pin = _commit_all(cu)
    fm = _repo(tmp_path / "FlashMLA")
    kfile = fm / bf.KERNEL_FILE
    kfile.parent.mkdir(parents=True)
    kfile.write_text(_fake_kernel())
    (fm / "setup.py").write_text("# not extracted\n")
    git(fm, "add", "-A")
    git(fm, "update-index", "--add", "--cacheinfo", f"160000,{pin},csrc/cutlass")
    git(fm, "commit", "-qm", "c")
    return fm, cu, pin


def test_sources_are_read_at_the_commit_flashmla_pins(sources, tmp_path):
    fm, cu, pin = sources
    head = git(fm, "rev-parse", "HEAD").strip()
    (cu / "include" / "cute" / "tensor.hpp").write_text("// a later CUTLASS\n")
    _commit_all(cu)  # CUTLASS moves on; FlashMLA's pin does not
    dest = tmp_path / "out"
    got = bf.extract(fm, "HEAD", cu, dest)
    assert got == {"flashmla": head, "cutlass": pin}
    assert (dest / "cutlass" / "include" / "cute" / "tensor.hpp").read_text() == "// cute\n"
    assert (dest / "FlashMLA" / bf.KERNEL_FILE).is_file()
    assert not (dest / "FlashMLA" / "setup.py").exists() and not (dest / "cutlass" / "README.md").exists()


def test_a_bare_mirror_without_a_config_file_is_read(sources, tmp_path):
    """The fetch tool's mirrors are bare git directories with no config (GitPython alone runs its
    git in the parent folder there)."""
    fm, cu, pin = sources
    bare = tmp_path / "mirror" / "repo"
    subprocess.run(["git", "clone", "-q", "--bare", str(cu), str(bare)], check=True)
    (bare / "config").unlink()
    got = bf.extract(fm, "HEAD", bare, tmp_path / "out")
    assert got["cutlass"] == pin


def test_dry_run_prints_the_compile_and_link_commands(sources, tmp_path, capsys):
    fm, cu, _ = sources
    assert bf.main([str(tmp_path / "lib"), "--flashmla", str(fm), "--cutlass", str(cu),
                    "--no-kv-loads", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(no key loads)" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("nvcc")]
    assert len(lines) == len(bf.SOURCES) + 2  # one per source, the C ABI, the link
    assert all("-DFM_NO_KV_LOADS" in ln for ln in lines[:-1])
    assert "arch=compute_90a,code=sm_90a" in lines[-1] and str(tmp_path / "lib" / bf.LIB_NAME) in lines[-1]
    assert not (tmp_path / "lib").exists()  # a dry run writes nothing


@pytest.mark.parametrize("which, says", [
    ("flashmla", "--flashmla/--rev: 'HEAD' is not a commit of"),
    ("cutlass", "--cutlass:"),
    ("nopin", "has no csrc/cutlass submodule"),
    ("rev", "--flashmla/--rev: 'no-such-rev' is not a commit of"),
])
def test_sources_git_cannot_give_are_refused_by_name(sources, tmp_path, capsys, which, says):
    fm, cu, _ = sources
    rev = "HEAD"
    if which == "flashmla":
        fm = tmp_path / "nowhere"
    elif which == "cutlass":
        cu = _repo(tmp_path / "other-cutlass")
        (cu / "x").write_text("x")
        _commit_all(cu)
    elif which == "nopin":
        git(fm, "rm", "-q", "--cached", "csrc/cutlass")
        git(fm, "commit", "-qm", "no pin")
    else:
        rev = "no-such-rev"
    assert bf.main([str(tmp_path / "lib"), "--flashmla", str(fm), "--rev", rev, "--cutlass", str(cu),
                    "--dry-run"]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "lib").exists()


def test_a_changed_kernel_source_exits_3(sources, tmp_path, capsys):
    fm, cu, _ = sources
    (fm / bf.KERNEL_FILE).write_text("// FlashMLA rewrote its loop\n")
    git(fm, "commit", "-qm", "rewrite", "--", bf.KERNEL_FILE)  # the pin stays (add -A would drop it)
    assert bf.main([str(tmp_path / "lib"), "--flashmla", str(fm), "--cutlass", str(cu), "--dry-run"]) == 3
    assert bf.KERNEL_FILE in capsys.readouterr().err


@pytest.fixture
def peers_dict(monkeypatch):
    """bench.peers.PEERS, restored after the test (register adds to it)."""
    pytest.importorskip("torch")
    from kdtree_pipeline.bench import peers

    monkeypatch.setattr(peers, "PEERS", dict(peers.PEERS))
    return peers.PEERS


def test_register_adds_one_chain_only_peer_per_label(peers_dict, tmp_path):
    lib = tmp_path / "fmnold"
    lib.mkdir()
    from kdtree_pipeline.bench import peers

    assert fp.register([f"fmsrc={tmp_path / 'fmsrc'}", f"fmnold={lib}"]) == ["fmsrc", "fmnold"]
    assert peers.PEERS["fmnold"].path == lib / fp.LIB_NAME
    assert peers.PEERS["fmnold"].masks(("tree", "chain")) == ("chain",)
    why = peers.PEERS["fmsrc"].check()  # no library there: named, before any CUDA call
    assert why and fp.LIB_NAME in why and "build_fm_src" in why


@pytest.mark.parametrize("spec, says", [
    ("fmsrc", "expected LABEL=DIR"),
    ("=build/lib/fmsrc", "expected LABEL=DIR"),
    ("fmsrc=", "expected LABEL=DIR"),
    ("flashmla=build/lib/fmsrc", "'flashmla' is already a system's name"),
    ("fmsrc=build/lib/fmsrc/other.so", f"expected a folder holding {fp.LIB_NAME}"),
])
def test_bad_specs_are_refused_and_nothing_is_registered(peers_dict, spec, says):
    from kdtree_pipeline.bench import peers

    before = dict(peers.PEERS)
    with pytest.raises(ValueError, match=re.escape(says)):
        fp.register(["ok=build/lib/ok", spec])
    assert peers.PEERS == before


def test_a_label_given_twice_is_refused(peers_dict):
    with pytest.raises(ValueError, match="'a' is already"):
        fp.register(["a=x", "a=y"])


@pytest.mark.parametrize("tool", ["ab_bench", "clock_probe"])
def test_the_probes_refuse_a_bad_fm_src_before_the_gpu(peers_dict, monkeypatch, capsys, tool):
    mod = load_tool(tool)
    argv = ["--cases", "bs8-N16-H8-L32768", "--fm-src", "flashmla=x"]
    if tool == "ab_bench":
        monkeypatch.setattr("sys.argv", ["ab_bench.py", "--label", "x", *argv])
        assert mod.main() == 2
    else:
        assert mod.main(argv) == 2
    assert "'flashmla' is already a system's name" in capsys.readouterr().err
