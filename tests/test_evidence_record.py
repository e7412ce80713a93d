"""evidence.make_record: which records name the kernel library a gate ran (a CPU gate's
names none and hashes none) and what the plan then takes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kdtree_engine.kernel import build as B
from kdtree_engine.kernel import library
from kdtree_pipeline import evidence
from kdtree_pipeline.phases import PHASES, phase
from kdtree_pipeline.run import PipelineError, load_evidence

CPU_GATES = ("build", "oracle-selftest")
GPU_GATES = ("oracle", "bench", "integrate", "smoke", "graph", "defrag")


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tree with src/ and csrc/ and a library stamped from its csrc/."""
    from conftest import stamp_library

    for var in ("KDTREE_LIB", "KDTREE_BUILD_DIR", "KDTREE_GIT_COMMIT", "KDTREE_ROOT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(library, "PACKAGED", tmp_path / "no-wheel" / B.LIB_NAME)
    root = tmp_path / "tree"
    for rel, text in {"csrc/kernel.cu": "// kernel\n", "csrc/a/b.cuh": "// b\n",
                      "src/kdtree_engine/__init__.py": '"""stand-in"""\n'}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    stamp_library(root)
    return root


def _csrc_files(root: Path) -> list[Path]:
    return [p for p in (root / "csrc").rglob("*") if p.is_file()]


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    reads: Counter = Counter()
    real = Path.read_bytes

    def counting(self: Path) -> bytes:
        reads[self] += 1
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counting)
    return reads


def test_a_gpu_gate_record_names_this_trees_library(tree):
    """A GPU gate's record carries the library's provenance: this tree's build, matching."""
    rec = evidence.make_record("oracle", True, {}, "ok", device=None, root=tree)
    lib = rec["library"]
    assert lib["matches"] is True and lib["tree_csrc"] == lib["built_from_csrc"] == B.csrc_hash(tree)
    assert lib["path"] == str(tree / "build" / "lib" / B.LIB_NAME)
    assert rec["code"]["content_hash"] == evidence.content_hash(tree)


@pytest.mark.parametrize("gate", CPU_GATES)
def test_a_cpu_gate_record_names_no_library_and_hashes_none(tree, monkeypatch, gate):
    """build and oracle-selftest run no kernel library: their records say library None,
    without reading the library's provenance (no .so hashed, csrc/ read once: the content hash)."""

    def refuse(*a, **k):
        raise AssertionError("a CPU gate's record must not read library provenance")

    monkeypatch.setattr(evidence, "provenance", refuse)
    monkeypatch.setattr(evidence, "file_sha256", refuse)
    monkeypatch.setattr(evidence, "csrc_hash", refuse)
    reads = _count_reads(monkeypatch)
    rec = evidence.make_record(gate, True, {}, "ok", device=None, root=tree)
    assert rec["library"] is None
    assert reads[tree / "build" / "lib" / B.LIB_NAME] == 0
    assert {reads[p] for p in _csrc_files(tree)} == {1}
    assert rec["code"]["content_hash"] == evidence.content_hash(tree)


def test_which_gates_run_the_kernel_library():
    """Read from the phase table: a gate some phase runs on a GPU, or one no phase names
    (its record keeps the provenance, as before), runs it; the CPU gates do not."""
    assert {g.gate for p in PHASES for g in p.gates} == set(CPU_GATES) | set(GPU_GATES)
    for gate in CPU_GATES:
        assert not evidence.runs_kernel_library(gate), gate
    for gate in (*GPU_GATES, "not-a-phase-gate"):
        assert evidence.runs_kernel_library(gate), gate


def test_an_explicit_library_is_recorded_as_given(tree, monkeypatch):
    monkeypatch.setattr(evidence, "provenance", lambda *a, **k: pytest.fail("given, not read"))
    given = {"path": "/x.so", "matches": False, "why": "told"}
    assert evidence.make_record("build", True, {}, "ok", device=None, root=tree, library=given)["library"] == given
    assert evidence.make_record("oracle", True, {}, "ok", device=None, root=tree, library=None)["library"] is None


def test_the_plan_takes_cpu_records_without_a_library_and_refuses_a_gpu_one_from_another_build(tree, tmp_path):
    """Phase 1 = build (CPU) + oracle + bench-micro (GPU): records made by make_record are
    taken while the library is this tree's build; once its stamp names other csrc/ (the
    sources the library was built from are not these), the GPU gates' records are refused
    and the CPU gate's still is not asked for a library."""
    p1 = phase(1)

    def write(directory: Path, p=p1) -> Path:
        for g in p.gates:
            evidence.write_record(evidence.make_record(g.gate, True, {}, "ok", variant=g.variant,
                                                       device=None, root=tree), directory)
        return directory

    got = load_evidence(p1, write(tmp_path / "ok"), tree)
    assert got["build"]["library"] is None
    assert got["oracle"]["library"]["matches"] is True and got["bench-micro"]["library"]["matches"] is True

    stamp = tree / "build" / "lib" / (B.LIB_NAME + library.STAMP_SUFFIX)
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "csrc_sha256": "0" * 64}))
    stale = write(tmp_path / "stale")
    with pytest.raises(PipelineError, match=r"oracle gate ran the kernel library .* this tree's csrc/ did not build"):
        load_evidence(p1, stale, tree)
    p0 = phase(0)
    assert load_evidence(p0, write(tmp_path / "p0", p0), tree).keys() == {"build", "oracle-selftest"}


def test_a_record_names_nvcc_as_the_build_gate_does(tmp_path, monkeypatch):
    """One reading of nvcc's version (kernel.build.nvcc_version) for the build and every record:
    the nvcc the build would use (NVCC here), and None where it cannot run."""
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    "echo 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    assert evidence.versions()["nvcc"] == B.nvcc_version(str(fake)) == "12.8 (V12.8.93)"
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    assert evidence.versions()["nvcc"] is None


def test_the_evidence_folder_is_the_variable_else_build_evidence(tree, tmp_path, monkeypatch):
    """One rule for where evidence goes: $KDTREE_EVIDENCE_DIR, else <root>/build/evidence; a
    gate takes no folder argument."""
    from kdtree_pipeline import build as build_gate

    monkeypatch.delenv("KDTREE_EVIDENCE_DIR", raising=False)
    monkeypatch.setenv("KDTREE_ROOT", str(tree))
    assert evidence.evidence_dir() == tree / "build" / "evidence"
    assert evidence.evidence_dir(tmp_path) == tmp_path / "build" / "evidence"
    rec = evidence.make_record("build", True, {}, "ok", device=None, root=tree)
    assert evidence.write_record(rec) == tree / "build" / "evidence" / "build.json"
    monkeypatch.setenv("KDTREE_EVIDENCE_DIR", str(tmp_path / "ev"))
    assert evidence.evidence_dir(tree) == tmp_path / "ev"
    assert evidence.write_record(rec) == tmp_path / "ev" / "build.json"
    with pytest.raises(SystemExit) as e:
        build_gate.main(["--evidence-dir", str(tmp_path)])
    assert e.value.code == 2
