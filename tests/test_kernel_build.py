"""The build gate's reading of ptxas -v output (CPU only: a recorded log, no nvcc)."""

from pathlib import Path

from kdtree_engine.kernel.build import BuildResult, parse_ptxas, serialized, spills
from kdtree_pipeline import build as G
from kdtree_pipeline import evidence

# Shaped like nvcc 13.0's ptxas -v output: module-level notes come before the
# "Compiling entry function" lines of the arch they belong to.
LOG = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 14394 by compiler to allow use of registers in GMMA in function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE'
{serial}ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN6kdtree19combine_wide_kernelILi8EEEvNS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kdtree19combine_wide_kernelILi8EEEvNS_6ParamsE
    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads
ptxas info    : Used 60 registers, used 1 barriers, 18560 bytes smem
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN6kdtree18verify_attn_kernelILi4EEEvNS_6ParamsE' for 'sm_120'
ptxas info    : Function properties for _ZN6kdtree18verify_attn_kernelILi4EEEvNS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers
"""
SERIAL = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
          "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
          "stage in the function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE'\n")


def _result(log: str) -> BuildResult:
    return BuildResult(Path("lib.so"), True, ["sm_90a", "sm_120"], [], "13.0", parse_ptxas(log), {}, log)


def test_clean_log_names_every_kernel_per_arch():
    k = parse_ptxas(LOG.format(serial="", spill=0))
    assert k["sm_90a"]["verify_attn_kernel_sm90"]["registers"] == 168
    assert k["sm_90a"]["combine_wide_kernel<8>"]["registers"] == 60
    assert k["sm_120"]["verify_attn_kernel<4>"]["registers"] == 254
    res = _result(LOG.format(serial="", spill=0))
    assert spills(res) == [] and serialized(res) == []


def test_serialized_wgmma_is_reported_for_the_arch_that_follows():
    res = _result(LOG.format(serial=SERIAL, spill=0))
    assert serialized(res) == ["verify_attn_kernel_sm90 on sm_90a"]
    assert "wgmma_serialized" not in res.kernels["sm_120"].get("verify_attn_kernel_sm90", {})


DIVERGENT = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
             "to program dependence on compiler-inserted WG.AR in divergent path in the function "
             "'_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE14CUtensorMap_sti'\n")
# a note that names a kernel but is not about serialization (HEAD's sm90 build has two)
INJECTED = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 1371 by compiler to allow use of "
            "registers in GMMA in function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE14CUtensorMap_sti'\n")


def test_every_serialization_note_counts_and_no_other():
    # C7520 (a wgmma pipeline across a branch ptxas thinks divergent) serializes as C7514 does
    res = _result(LOG.format(serial=DIVERGENT, spill=0))
    assert serialized(res) == ["verify_attn_kernel_sm90 on sm_90a"]
    res = _result(LOG.format(serial=INJECTED, spill=0))
    assert serialized(res) == []


def test_spills_are_reported():
    res = _result(LOG.format(serial="", spill=32))
    assert spills(res) == ["combine_wide_kernel<8> on sm_90a: 32 B spill stores, 32 B spill loads"]


class _FakeLib:
    """kdtree_choose_config's answers, as a built library gives them (no nvcc here)."""

    def __init__(self, path, smem=90624, emu_tile=2):
        self.smem, self.emu_tile = smem, emu_tile

    def choose_config(self, props, target=0, flags=0, tile=0):
        from kdtree_engine.kernel import library as L

        c = L.KdtreeConfig()
        c.kernel, c.tile, c.block_rows, c.threads = 2, self.emu_tile if target else 2, 64, 256
        c.smem_bytes = c.smem_request = self.smem
        c.ctas_per_sm = 1 if self.smem + 1024 <= props.smem_per_sm else 0
        c.name = b"mma.sync-64x32-qreg"
        return 0, c


QREG_120 = ("ptxas info    : Compiling entry function '_ZN6kdtree27verify_attn_kernel_mma_qregENS_6ParamsE' for 'sm_120'\n"
            "    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
            "ptxas info    : Used {regs} registers, used 5 barriers\n")


def _fit(monkeypatch, spill=0, regs=255, **lib):
    from kdtree_engine.kernel import library as L

    monkeypatch.setattr(L, "Library", lambda path: _FakeLib(path, **lib))
    res = _result(LOG.format(serial="", spill=0) + QREG_120.format(spill=spill, regs=regs))
    return G.sm120_fit(res)


def test_the_sm120_tile_fits_sm120(monkeypatch):
    fit, problems = _fit(monkeypatch)
    assert problems == []
    assert fit["kernel"] == "verify_attn_kernel_mma_qreg" and fit["smem_bytes"] <= fit["smem_limit"] == 99 * 1024
    assert fit["registers"] == 255 and fit["ctas_per_sm"] == 1


def test_an_sm120_tile_over_sm120s_limits_fails_the_build_gate(monkeypatch):
    _, problems = _fit(monkeypatch, smem=120 * 1024)
    assert any("sm_120 allows 101376" in p for p in problems)
    _, problems = _fit(monkeypatch, spill=8)
    assert any("spills on sm_120" in p for p in problems)
    _, problems = _fit(monkeypatch, emu_tile=1)
    assert any("emulation on an H200 chooses otherwise" in p for p in problems)


def test_a_cached_build_counts_sass_it_could_not_count_before(tmp_path, monkeypatch):
    """A stamp written where cuobjdump was missing holds no SASS counts; an unchanged tree
    built again where cuobjdump is present counts them (and keeps them), instead of
    reporting "SASS not counted" until the stamp is deleted."""
    import json

    from kdtree_engine.kernel import build as B

    monkeypatch.setattr(B, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(B, "nvcc_version", lambda nvcc: "13.0")
    archs = B.parse_archs(None)
    flags = B.flags_for(archs)
    root = B.source_root()
    (tmp_path / B.LIB_NAME).write_bytes(b"lib")
    stamp_file = tmp_path / (B.LIB_NAME + ".stamp.json")
    stamp = B._stamp(B.csrc_hash(root), flags, "13.0")
    stamp_file.write_text(json.dumps({"stamp": stamp, "kernels": {}, "sass": {}, "log": ""}))
    counted = {a: {"HMMA": 1} for a in archs}

    def no_compile(*a, **k):
        raise AssertionError("an unchanged tree must not be compiled again")

    monkeypatch.setattr(B.subprocess, "run", no_compile)
    monkeypatch.setattr(B, "sass_counts", lambda lib, archs: {})
    assert B.build(out_dir=tmp_path).sass == {}  # still no cuobjdump: still not counted
    monkeypatch.setattr(B, "sass_counts", lambda lib, archs: counted)
    res = B.build(out_dir=tmp_path)
    assert not res.rebuilt and res.sass == counted
    assert json.loads(stamp_file.read_text())["sass"] == counted


def test_sass_counts_finds_cuobjdump_once(tmp_path, monkeypatch):
    """cuobjdump is looked up once for all archs; an arch it cannot dump counts as an error,
    and without cuobjdump nothing is counted."""
    import kdtree_engine.kernel.build as B

    tool = tmp_path / "cuobjdump"
    tool.write_text('#!/bin/sh\n[ "$3" = sm_90a ] || exit 1\n'
                    "printf '        /*0010*/  HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\\n"
                    "        /*0020*/  LDSM.16.M88.4 R8, [R2] ;\\n        /*0030*/  HMMA.16816.F32.BF16 R4 ;\\n'\n")
    tool.chmod(0o755)
    looked: list[int] = []
    monkeypatch.setattr(B, "find_cuobjdump", lambda: looked.append(1) or str(tool))
    counts = B.sass_counts(tmp_path / "lib.so", ["sm_90a", "sm_120"])
    assert len(looked) == 1
    assert counts["sm_120"] == {"error": 1}
    assert counts["sm_90a"] == {**dict.fromkeys(B.SASS_FAMILIES, 0), "HMMA": 2, "LDSM": 1}
    monkeypatch.setattr(B, "find_cuobjdump", lambda: None)
    assert B.sass_counts(tmp_path / "lib.so", ["sm_90a"]) == {}


def test_the_gate_and_the_variant_tool_run_one_nvcc_command(tmp_path, monkeypatch):
    """build() compiles with nvcc_command(), the one command line an A/B variant reuses: a variant
    differs from the gate's library only by the flags it adds (placed after the gate's)."""
    import subprocess

    from kdtree_engine.kernel import build as B

    monkeypatch.setattr(B, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(B, "nvcc_version", lambda nvcc: "13.0")
    monkeypatch.setattr(B, "sass_counts", lambda lib, archs: {})
    seen = []

    def fake_nvcc(cmd, **k):
        seen.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"lib")
        return subprocess.CompletedProcess(cmd, 0, LOG.format(serial="", spill=0), "")

    monkeypatch.setattr(B.subprocess, "run", fake_nvcc)
    archs = B.parse_archs(None)
    B.build(out_dir=tmp_path, force=True)
    root = B.source_root()
    assert seen == [B.nvcc_command(root, tmp_path / (B.LIB_NAME + ".tmp"), archs, nvcc="nvcc")]
    variant = B.nvcc_command(root, tmp_path / "v.so", archs, ["-DX=1"])
    gate = B.nvcc_command(root, tmp_path / "v.so", archs)
    assert variant[: len(B.flags_for(archs)) + 1] == gate[: len(B.flags_for(archs)) + 1]
    assert variant.index("-DX=1") == len(B.flags_for(archs)) + 1 and len(variant) == len(gate) + 1


def test_a_library_names_the_sources_that_built_it(tmp_path, monkeypatch):
    """build() stamps the csrc/ hash and the library's sha256; provenance() then says whether a
    library is this tree's build: True for it, False once csrc/ changes or the file is replaced,
    None (with why) for a library without a stamp (a variant) or no library at all."""
    import subprocess

    from kdtree_engine.kernel import build as B
    from kdtree_engine.kernel import library

    monkeypatch.delenv("KDTREE_LIB", raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "no-wheel" / B.LIB_NAME)
    root = tmp_path / "tree"
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "k.cu").write_text("// kernel\n")
    monkeypatch.setattr(B, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(B, "nvcc_version", lambda nvcc: "13.0")
    monkeypatch.setattr(B, "sass_counts", lambda lib, archs: {})

    def fake_nvcc(cmd, **k):
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"compiled " + (root / "csrc" / "k.cu").read_bytes())
        return subprocess.CompletedProcess(cmd, 0, LOG.format(serial="", spill=0), "")

    monkeypatch.setattr(B.subprocess, "run", fake_nvcc)
    out = root / "build" / "lib"
    assert evidence.provenance(root=root)["matches"] is None  # nothing built yet
    monkeypatch.delenv("KDTREE_BUILD_DIR", raising=False)
    res = B.build(root=root)  # no out_dir: the named tree's build/lib, where provenance looks
    assert res.library == out / B.LIB_NAME
    prov = evidence.provenance(root=root)
    assert prov["path"] == str(res.library) and prov["matches"] is True
    assert prov["built_from_csrc"] == prov["tree_csrc"] == B.csrc_hash(root)
    (root / "csrc" / "k.cu").write_text("// kernel, edited after the build\n")
    stale = evidence.provenance(root=root)
    assert stale["matches"] is False and "was built from csrc/" in stale["why"]
    B.build(out_dir=out, root=root)  # the stamp no longer matches: rebuilt
    assert evidence.provenance(root=root)["matches"] is True
    res.library.write_bytes(b"copied over")
    swapped = evidence.provenance(root=root)
    assert swapped["matches"] is False and "not the file its build stamp describes" in swapped["why"]
    variant = tmp_path / "v" / B.LIB_NAME
    variant.parent.mkdir()
    variant.write_bytes(b"a variant")
    monkeypatch.setenv("KDTREE_LIB", str(variant))
    v = evidence.provenance(root=root)
    assert v["path"] == str(variant) and v["matches"] is None and "no readable build stamp" in v["why"]


def test_a_stamp_from_before_provenance_gains_the_hashes_without_a_rebuild(tmp_path, monkeypatch):
    """A stamp written before it named csrc/ and the library (same sources, same flags) is
    completed in place, not rebuilt: the library then reads as this tree's."""
    import json

    from kdtree_engine.kernel import build as B
    from kdtree_engine.kernel import library

    monkeypatch.delenv("KDTREE_LIB", raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "no-wheel" / B.LIB_NAME)
    monkeypatch.setattr(B, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(B, "nvcc_version", lambda nvcc: "13.0")
    monkeypatch.setattr(B, "sass_counts", lambda lib, archs: {"sm_90a": {"HMMA": 1}})
    root = tmp_path / "tree"
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "k.cu").write_text("// kernel\n")
    out = root / "build" / "lib"
    out.mkdir(parents=True)
    (out / B.LIB_NAME).write_bytes(b"old build")
    stamp = B._stamp(B.csrc_hash(root), B.flags_for(B.parse_archs(None)), "13.0")
    (out / (B.LIB_NAME + ".stamp.json")).write_text(json.dumps({"stamp": stamp, "kernels": {}, "sass": {"x": {}}}))

    def no_compile(*a, **k):
        raise AssertionError("an unchanged tree must not be compiled again")

    monkeypatch.setattr(B.subprocess, "run", no_compile)
    assert not B.build(out_dir=out, root=root).rebuilt
    assert evidence.provenance(root=root)["matches"] is True


def test_the_library_is_looked_for_where_the_gate_writes_it(tmp_path, monkeypatch):
    """library.default_library_path is build.default_out_dir's library: KDTREE_BUILD_DIR (the
    gate's folder) when set, named checkout or not (so provenance(root=...) describes the file
    load() opens), else the checkout's build/lib."""
    from kdtree_engine.kernel import build as B
    from kdtree_engine.kernel import library

    monkeypatch.delenv("KDTREE_LIB", raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "no-wheel" / B.LIB_NAME)
    monkeypatch.setenv("KDTREE_BUILD_DIR", str(tmp_path / "out"))
    assert B.default_out_dir() == tmp_path / "out"
    assert library.default_library_path() == tmp_path / "out" / B.LIB_NAME
    assert B.default_out_dir(tmp_path / "tree") == tmp_path / "out"
    assert library.default_library_path(tmp_path / "tree") == tmp_path / "out" / B.LIB_NAME
    assert evidence.provenance(root=tmp_path / "tree")["path"] == str(library.default_library_path())
    monkeypatch.delenv("KDTREE_BUILD_DIR")
    assert B.default_out_dir(tmp_path / "tree") == tmp_path / "tree" / "build" / "lib"
    assert library.default_library_path(tmp_path / "tree") == tmp_path / "tree" / "build" / "lib" / B.LIB_NAME
    assert B.default_out_dir() == B.source_root() / "build" / "lib"


def test_kernel_names_keep_every_template_argument():
    """A kernel of two template arguments reads as such in the stamp and the build headline
    (combine_onepass_kernel<8, 10> was reported mangled); one argument and none still read."""
    from kdtree_engine.kernel.build import _short
    assert _short("_ZN6kdtree22combine_onepass_kernelILi8ELi10EEEvNS_6ParamsE") == "combine_onepass_kernel<8, 10>"
    assert _short("_ZN6kdtree21combine_narrow_kernelILi16EEEvNS_6ParamsE") == "combine_narrow_kernel<16>"
    assert _short("_ZN6kdtree27verify_attn_kernel_mma_qregENS_6ParamsE") == "verify_attn_kernel_mma_qreg"
    assert _short("_ZN6kdtree11plan_kernelENS_6ParamsE") == "plan_kernel"
    # bool arguments (the batch schedule's instances: PLANNED)
    assert _short("_ZN6kdtree27verify_attn_kernel_mma_qregILb1EEEvNS_6ParamsE") == "verify_attn_kernel_mma_qreg<true>"
    assert _short("_ZN6kdtree21combine_narrow_kernelILi8ELb0EEEvNS_6ParamsE") == "combine_narrow_kernel<8, false>"
    assert _short("_ZN6kdtree4sm9023verify_attn_kernel_sm90ILb0EEEvNS_6ParamsE14CUtensorMap_sti") == \
        "verify_attn_kernel_sm90<false>"


QREG_120_PLANNED = ("ptxas info    : Compiling entry function '_ZN6kdtree27verify_attn_kernel_mma_qregILb{p}EEEvNS_6ParamsE' "
                    "for 'sm_120'\n"
                    "    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
                    "ptxas info    : Used {regs} registers, used 5 barriers\n")


def test_every_instance_of_the_sm120_kernel_is_checked(monkeypatch):
    """The sm_120 kernel in two instances (the 3-D grid's, the batch schedule's): the fit
    checks both, so a spill in either fails it, and reports the larger register count."""
    from kdtree_engine.kernel import library as L

    monkeypatch.setattr(L, "Library", lambda path: _FakeLib(path))

    def fit(spill_planned):
        log = LOG.format(serial="", spill=0) + QREG_120_PLANNED.format(p=0, spill=0, regs=200) + \
            QREG_120_PLANNED.format(p=1, spill=spill_planned, regs=168)
        return G.sm120_fit(_result(log))

    f, problems = fit(0)
    assert problems == [] and f["registers"] == 200
    _, problems = fit(8)
    assert problems == ["verify_attn_kernel_mma_qreg<true> spills on sm_120"]


def _gate(monkeypatch, tmp_path, log: str = "", archs=("sm_90a",), error: str | None = None, rebuilt=True):
    """Run the build gate's main on a stand-in build of ``log`` (a BuildError when ``error``);
    its exit code and record."""
    import json

    from kdtree_engine.kernel.build import BuildError

    lib = tmp_path / "libkdtree_verify.so"
    lib.write_bytes(b"\0" * 1000)

    def fake_build(a, out, force):
        if error:
            raise BuildError(error)
        return BuildResult(lib, rebuilt, list(archs), ["-O3"], "13.0 (V13.0.88)", parse_ptxas(log), {}, log)

    monkeypatch.setattr(G, "build", fake_build)
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path / "ev"))
    code = G.main([])
    return code, json.loads((tmp_path / "ev" / "build.json").read_text())


def test_the_build_gate_fails_on_a_compile_error_with_its_first_line(monkeypatch, tmp_path, capsys):
    code, rec = _gate(monkeypatch, tmp_path, error="nvcc failed (exit 1):\nkernel.cu(3): error: bad")
    assert code == 1 and rec["passed"] is False and rec["headline"] == "build failed"
    assert rec["reason"] == "nvcc failed (exit 1):" and rec["metrics"] == {} and rec["device"] is None
    assert capsys.readouterr().err.startswith("build: FAILED: nvcc failed (exit 1):\nkernel.cu(3): error: bad")


def test_the_build_gate_names_the_first_reason_it_is_unfit(monkeypatch, tmp_path, capsys):
    code, rec = _gate(monkeypatch, tmp_path, LOG.format(serial=SERIAL, spill=8))
    assert code == 1 and rec["headline"] == "build failed"
    assert rec["reason"] == "register spills: combine_wide_kernel<8> on sm_90a: 8 B spill stores, 8 B spill loads"
    code, rec = _gate(monkeypatch, tmp_path, LOG.format(serial=SERIAL, spill=0))
    assert code == 1 and rec["reason"] == (
        "wgmma serialized by ptxas (C7514: an accumulator touched while its MMA is in flight; C7520: a pipeline "
        "across a divergent branch): verify_attn_kernel_sm90 on sm_90a")
    code, rec = _gate(monkeypatch, tmp_path, LOG.format(serial="", spill=0), archs=("sm_90a", "sm_100a"))
    assert code == 1 and rec["reason"] == "ptxas reported no kernels for ['sm_100a']"
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "build: FAIL: ptxas reported no kernels for ['sm_100a']  (evidence ")


def test_the_build_gate_passes_with_its_headline_metrics_and_report(monkeypatch, tmp_path, capsys):
    log = LOG.format(serial="", spill=0)
    code, rec = _gate(monkeypatch, tmp_path, log, rebuilt=False)
    assert code == 0 and rec["passed"] is True and rec["reason"] is None
    assert rec["headline"] == ("sm_90a built with nvcc 13.0 (V13.0.88); sm_90a: 168 regs max, 0 spills; "
                               "SASS not counted (no cuobjdump)")
    m = rec["metrics"]
    assert m["archs"] == ["sm_90a"] and m["nvcc"] == "13.0 (V13.0.88)" and m["flags"] == ["-O3"]
    assert m["library_bytes"] == 1000 and m["rebuilt"] is False and m["sm120_fit"] == {}
    assert m["kernels"] == parse_ptxas(log) and m["sass"] == {}
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"build: {tmp_path / 'libkdtree_verify.so'} (up to date)"
    assert out[1] == f"  {'sm_90a':7s} {'verify_attn_kernel_sm90':24s}  168 regs  spills 0/0 B"
    assert out[-1] == f"build: PASS  (evidence {tmp_path / 'ev' / 'build.json'})"


def test_the_build_gate_reports_the_sm120_fit_or_its_problems(monkeypatch, tmp_path):
    from kdtree_engine.kernel import library as L

    log = LOG.format(serial="", spill=0) + QREG_120.format(spill=0, regs=255)
    monkeypatch.setattr(L, "Library", lambda path: _FakeLib(path))
    code, rec = _gate(monkeypatch, tmp_path, log, archs=("sm_90a", "sm_120"))
    assert code == 0
    assert rec["headline"].endswith("; sm_120 tile mma.sync-64x32-qreg fits sm_120 (88.5 of 99 KB, 1 CTA/SM, "
                                    "255 regs x 256 threads)")
    monkeypatch.setattr(L, "Library", lambda path: _FakeLib(path, smem=120 * 1024))
    code, rec = _gate(monkeypatch, tmp_path, log, archs=("sm_90a", "sm_120"))
    assert code == 1 and rec["reason"].startswith("sm_120 limits: the sm_120 emulation on an H200 chooses otherwise")
    assert "; sm_120 tile mma.sync-64x32-qreg takes 122880 B of shared memory; sm_120 allows 101376" in rec["reason"]
