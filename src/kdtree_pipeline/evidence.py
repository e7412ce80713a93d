"""Evidence records: what one gate proved, on which code, on which machine.

A gate ends by calling :func:`make_record` and :func:`write_record`. The record
is plain JSON so that a gate run on a remote GPU host can be carried back and
recorded here (``invoke phaseN --evidence DIR``). The content hash of ``src/``
and ``csrc/`` ties a record to the code it ran on: a record whose hash differs
from the code being committed is refused by the pipeline.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

from kdtree_engine.kernel import library as L
from kdtree_engine.kernel.build import BuildError, csrc_hash, file_sha256, find_nvcc, nvcc_version
from kdtree_pipeline.phases import PHASES, record_name

SCHEMA = 1
HASHED_DIRS = ("src", "csrc")
_SKIP_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
_SKIP_SUFFIXES = (".pyc", ".pyo")
REQUIRED_KEYS = ("schema", "gate", "passed", "headline", "metrics", "device", "versions", "code", "time_utc")


class EvidenceError(ValueError):
    """An evidence file is missing, unreadable, truncated or malformed."""


def repo_root(start: Path | None = None) -> Path:
    """The project root: ``$KDTREE_ROOT``, else the nearest folder above ``start``
    (default: the working directory) holding both ``csrc/`` and ``src/kdtree_engine``."""
    env = os.environ.get("KDTREE_ROOT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for cand in (here, *here.parents):
        if (cand / "csrc").is_dir() and (cand / "src" / "kdtree_engine").is_dir():
            return cand
    # Fall back to the checkout this module lives in (editable installs).
    pkg_root = Path(__file__).resolve().parents[3]
    if (pkg_root / "src" / "kdtree_engine").is_dir():
        return pkg_root
    raise EvidenceError(
        f"cannot find the kdtree-engine project root above {here} "
        "(a folder with csrc/ and src/kdtree_engine/); set KDTREE_ROOT"
    )


def _hashed_files(root: Path) -> list[Path]:
    files = []
    for top in HASHED_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for p in base.rglob("*"):
            rel = p.relative_to(root)
            if not p.is_file() or p.is_symlink():
                continue
            if _SKIP_PARTS.intersection(rel.parts) or p.name.endswith(_SKIP_SUFFIXES):
                continue
            if any(part.endswith(".egg-info") for part in rel.parts):
                continue
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def content_hash(root: Path | None = None) -> str:
    """sha256 over (path, bytes) of every source file under src/ and csrc/.

    Computed from the files on disk, not from git, so that it is the same on a
    GPU host that received a copy of the working tree without ``.git``.
    """
    root = root or repo_root()
    h = hashlib.sha256()
    for p in _hashed_files(root):
        rel = p.relative_to(root).as_posix().encode()
        data = p.read_bytes()
        h.update(len(rel).to_bytes(4, "little") + rel)
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def git_commit(root: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether src/ or csrc/ differ from it); ``$KDTREE_GIT_COMMIT``
    wins (a GPU host receives the tree without ``.git``; pass the commit along)."""
    env = os.environ.get("KDTREE_GIT_COMMIT")
    if env:
        return env, None
    root = root or repo_root()
    try:
        import git  # GitPython

        repo = git.Repo(root, search_parent_directories=False)
        commit = repo.head.commit.hexsha
        dirty = any(repo.is_dirty(untracked_files=True, path=d) for d in HASHED_DIRS)
        return commit, dirty
    except Exception:  # no git, not a repository, no commit yet
        return None, None


def _version(mod: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _nvcc_version() -> str | None:
    """The version of the nvcc the build gate would use, as it records it ("13.0 (V13.0.88)"),
    or None on a machine without a working one."""
    try:
        return nvcc_version(find_nvcc())
    except BuildError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of the libraries on this machine that a gate may compute with (None: absent).
    The record keeps them all; the plan keeps, and compares, only those its gate uses
    (:data:`kdtree_pipeline.phases.VERSIONS_USED`)."""
    torch_v = cuda_v = None
    try:
        import torch

        torch_v = torch.__version__
        cuda_v = torch.version.cuda
    except Exception:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch_v,
        "cuda": cuda_v,
        "triton": _version("triton"),
        "sglang": _version("sglang"),
        "nvcc": _nvcc_version(),
    }


def device_info() -> dict[str, Any] | None:
    """The CUDA device a gate ran on, or None on a machine without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        return {
            "name": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sm_count": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
        }
    except Exception:
        return None


def provenance(path: Path | str | None = None, root: Path | None = None) -> dict:
    """Which kernel library a gate runs, and whether this checkout's csrc/ built it: the path
    (``kdtree_engine.kernel.library.default_library_path(root)`` unless given), the file's sha256, and from the build stamp
    beside it the csrc/ hash it was compiled from. ``matches`` is True when that hash is
    ``root``'s csrc/ hash and the file is the one the stamp describes; False when either
    differs (a build of older sources, a file copied over the build); None when it cannot
    tell (no such file; no stamp, as for a library built by hand with extra flags; a stamp
    without the hashes); ``why`` says which. Reads files only: no GPU, nothing loaded."""
    root = Path(root) if root is not None else repo_root()
    p = Path(path) if path is not None else L.default_library_path(root)
    out = {"path": str(p), "sha256": None, "built_from_csrc": None, "tree_csrc": csrc_hash(root),
           "matches": None, "why": None}
    if not p.is_file():
        out["why"] = f"no library at {p}"
        return out
    out["sha256"] = file_sha256(p)
    stamp_file = p.with_name(p.name + L.STAMP_SUFFIX)
    try:
        stamp = json.loads(stamp_file.read_text())
    except (OSError, ValueError) as e:
        out["why"] = f"no readable build stamp at {stamp_file} ({e.__class__.__name__}): not built by the build gate"
        return out
    built, lib_sha = stamp.get("csrc_sha256"), stamp.get("library_sha256")
    out["built_from_csrc"] = built
    if not built or not lib_sha:
        out["why"] = f"the build stamp {stamp_file} names no csrc/ or library hash (rebuild it)"
    elif lib_sha != out["sha256"]:
        out["matches"], out["why"] = False, f"{p} is not the file its build stamp describes (sha256 {lib_sha[:12]})"
    elif built != out["tree_csrc"]:
        out["matches"], out["why"] = False, (f"{p} was built from csrc/ {built[:12]}, this tree's csrc/ is "
                                             f"{out['tree_csrc'][:12]}")
    else:
        out["matches"] = True
    return out


def library_provenance(root: Path) -> dict[str, Any]:
    """:func:`provenance` for ``root``, or what kept it from being read (never raises:
    a record is still written, and a GPU gate's then cannot be recorded into a plan)."""
    try:
        return provenance(root=root)
    except Exception as e:  # noqa: BLE001 - provenance is reported, not a reason to lose the record
        return {"path": None, "matches": None, "why": f"provenance not read: {e.__class__.__name__}: {e}"}


def runs_kernel_library(gate: str) -> bool:
    """Whether ``gate`` runs the kernel library, so that its record names which one: the
    gates a phase runs on a GPU (kdtree_pipeline.phases), and any gate no phase names. The CPU
    gates (``build``, ``oracle-selftest``) run none, and the plan never asks theirs
    (kdtree_pipeline.run.load_evidence checks the library of GPU gates only)."""
    gates = [g for p in PHASES for g in p.gates if g.gate == gate]
    return not gates or any(g.needs_gpu for g in gates)


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def make_record(
    gate: str,
    passed: bool,
    metrics: dict[str, Any],
    headline: str,
    *,
    reason: str | None = None,
    variant: str | None = None,
    details: dict[str, Any] | None = None,
    device: dict[str, Any] | None | str = "auto",
    root: Path | None = None,
    library: dict[str, Any] | None | str = "auto",
) -> dict[str, Any]:
    """Build an evidence record. ``headline`` is the one-line figure the plan
    shows; ``reason`` says why a failed gate failed; ``details`` holds the bulk
    (per-case results) and stays out of the plan. ``variant`` names one of
    several configurations of a gate (the bench gate's suite: ``micro``,
    ``long-context``); the file is then ``<gate>-<variant>.json``. ``library``: which kernel
    library the gate ran and whether this tree's csrc/ built it (``auto``:
    :func:`provenance` for ``root`` where the gate runs the
    library, :func:`runs_kernel_library`, else None: a CPU gate's record hashes no library);
    a plan records a GPU gate's proof only where it did (kdtree_pipeline.run.load_evidence)."""
    root = root or repo_root()
    commit, dirty = git_commit(root)
    if library == "auto":
        library = library_provenance(root) if runs_kernel_library(gate) else None
    return {
        "schema": SCHEMA,
        "gate": gate,
        "variant": variant,
        "passed": bool(passed),
        "reason": reason,
        "headline": headline,
        "metrics": metrics,
        "details": details or {},
        "device": device_info() if device == "auto" else device,
        "versions": versions(),
        "code": {"commit": commit, "dirty": dirty, "content_hash": content_hash(root)},
        "library": library,
        "host": platform.node(),
        # Where the gate ran: lets the plan make paths in metrics relative (the
        # evidence file itself is not committed; the plan keeps nothing machine-local).
        "root": str(root.resolve()),
        "time_utc": now_utc(),
    }


def evidence_dir(root: Path | None = None) -> Path:
    """Where the gates write their evidence and a phase reads it: ``$KDTREE_EVIDENCE_DIR``,
    else ``<root>/build/evidence`` (``root``: :func:`repo_root`). This is the one rule: a gate
    takes no folder argument, and ``invoke phaseN`` sets the variable for the gates it runs."""
    env = os.environ.get("KDTREE_EVIDENCE_DIR")
    return Path(env) if env else (root or repo_root()) / "build" / "evidence"


def write_record(record: dict[str, Any], directory: Path | str | None = None) -> Path:
    """Write ``<directory>/<gate>[-<variant>].json`` atomically and return its path
    (``directory``: :func:`evidence_dir` unless given)."""
    d = Path(directory) if directory is not None else evidence_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{record_name(record['gate'], record.get('variant'))}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def refuse_without_cuda(gate: str, *, variant: str | None = None,
                        metrics: dict[str, Any] | None = None) -> int | None:
    """A GPU gate on a machine without CUDA: print why, write a failing record and
    return the exit code 1 (a gate never passes by skipping); None when a GPU is visible."""
    import sys

    import torch

    if torch.cuda.is_available():
        return None
    msg = f"the {gate} gate needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False)"
    print(f"{gate}: FAILED: {msg}", file=sys.stderr)
    write_record(make_record(gate, False, metrics or {}, "not run: no CUDA GPU", reason=msg, variant=variant))
    return 1


def load_record(path: Path | str) -> dict[str, Any]:
    """Read and validate one evidence file; raise :class:`EvidenceError` with the
    file name and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise EvidenceError(f"evidence file {path}: cannot read ({e.strerror or e})") from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise EvidenceError(f"evidence file {path}: not valid JSON (truncated or corrupt?): {e}") from None
    if not isinstance(rec, dict):
        raise EvidenceError(f"evidence file {path}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise EvidenceError(f"evidence file {path}: missing keys {missing}")
    if rec["schema"] != SCHEMA:
        raise EvidenceError(f"evidence file {path}: schema {rec['schema']!r}, expected {SCHEMA}")
    code = rec["code"]
    if not isinstance(code, dict) or not code.get("content_hash"):
        raise EvidenceError(f"evidence file {path}: no code.content_hash")
    if not isinstance(rec["passed"], bool):
        raise EvidenceError(f"evidence file {path}: 'passed' must be true or false")
    return rec
