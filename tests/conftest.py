"""Shared test setup: skip marked tests by what the machine has, and a temporary
git repository laid out like the project for the pipeline tests.

The markers themselves (gpu, sm90, sglang, nvcc) are registered in
pyproject.toml; here a marked test is skipped, with the reason, when the
machine lacks what the marker names. A *gate* never treats such a skip as a pass.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]


def _cuda_capability() -> tuple[int, int] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_capability()
    except Exception:
        pass
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cap = _cuda_capability()
    reasons = {
        "gpu": None if cap else "needs a CUDA GPU (none here)",
        "sm90": None if cap and cap[0] == 9 else "needs compute capability 9.x",
        "nvcc": None if shutil.which("nvcc") else "needs nvcc on PATH",
        "sglang": None if importlib.util.find_spec("sglang") else "needs the sglang package",
    }
    for item in items:
        for name, reason in reasons.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def git(repo: Path, *args: str) -> str:
    """Run a real git command in ``repo`` and return its stdout."""
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True)
    return out.stdout


#: A stand-in noxfile for the temporary project: each gate session writes a real
#: evidence record for the temporary tree (FAIL_GATE=<gate> makes one fail).
FAKE_NOXFILE = '''
import os, sys
import nox

SCRIPT = """
import os, sys
from kdtree_pipeline import evidence
gate, variant = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
ok = os.environ.get("FAIL_GATE") != gate
rec = evidence.make_record(gate, ok, {"value": 1.5, "count": 3}, f"{gate} fine" if ok else "broke",
                           variant=variant, device=None, reason=None if ok else "told to fail")
evidence.write_record(rec)
sys.exit(0 if ok else 1)
"""

def _gate(session, gate):
    variant = session.posargs[1] if len(session.posargs) > 1 else None
    session.run(sys.executable, "-c", SCRIPT, gate, *([variant] if variant else []))

@nox.session
def build(session):
    _gate(session, "build")

@nox.session(name="oracle-selftest")
def oracle_selftest(session):
    _gate(session, "oracle-selftest")
'''


def stamp_library(root: Path, data: bytes = b"stand-in kernel library\n") -> Path:
    """Put a stand-in library in ``root``/build/lib with the build gate's stamp for ``root``'s
    csrc/ as it is now: the library a GPU gate of the temporary project "ran" (records name it,
    kernel.library.provenance). Call it again after changing csrc/ to "rebuild"."""
    import json

    from kdtree_engine.kernel import build as B
    from kdtree_engine.kernel import library

    lib = root / "build" / "lib" / B.LIB_NAME
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(data)
    stamp = {"stamp": "test", "csrc_sha256": B.csrc_hash(root), "library_sha256": B.file_sha256(lib)}
    lib.with_name(lib.name + library.STAMP_SUFFIX).write_text(json.dumps(stamp))
    return lib


@pytest.fixture
def project_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real git repository (branch main, one commit) laid out like the project:
    tasks.py, invoke.yaml, templates/ and src/ copied from this checkout, a tiny csrc/,
    and a stand-in noxfile whose gate sessions write evidence."""
    for var in ("KDTREE_ROOT", "KDTREE_EVIDENCE_DIR", "KDTREE_GIT_COMMIT", "KDTREE_NOX_NO_VENV"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "proj"
    (root / "templates").mkdir(parents=True)
    shutil.copy(PROJECT / "templates" / "plan.md.j2", root / "templates" / "plan.md.j2")
    shutil.copy(PROJECT / "tasks.py", root / "tasks.py")
    shutil.copy(PROJECT / "invoke.yaml", root / "invoke.yaml")
    (root / "noxfile.py").write_text(FAKE_NOXFILE)
    (root / "csrc").mkdir()
    (root / "csrc" / "kernel.cu").write_text('extern "C" int kdtree_verify(void) { return 0; }\n')
    # the real packages: tasks.py puts this src/ first on sys.path (kdtree_pipeline runs from the checkout)
    for pkg in ("kdtree_engine", "kdtree_pipeline"):
        shutil.copytree(PROJECT / "src" / pkg, root / "src" / pkg, ignore=shutil.ignore_patterns("__pycache__", "_lib"))
    (root / "README.md").write_text("temporary project\n")
    (root / ".gitignore").write_text("/build/\n__pycache__/\n.nox/\n")
    stamp_library(root)
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Pipeline Test")
    git(root, "config", "user.email", "pipeline-test@localhost")
    git(root, "config", "core.hooksPath", ".git/hooks")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    return root
