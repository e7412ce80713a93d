"""README's set-up script keeps an installed torch, and the repository's
references point into its own design document (CPU, no network: a stand-in
python records what the script would install)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
STUB = """#!/bin/sh
if [ "$1" = "-c" ]; then
  case "$2" in *"import torch"*) [ -n "$HAS_TORCH" ] && { echo "$HAS_TORCH"; exit 0; }; exit 1;; esac
fi
echo "$*" >> "$LOG"
"""


def _setup(tmp_path: Path, has_torch: str) -> tuple[str, list[str]]:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "pip.log"
    env = {**os.environ, "PYTHON": str(stub), "LOG": str(log), "HAS_TORCH": has_torch}
    env.pop("KDTREE_TORCH_PIN", None)
    out = subprocess.run(["bash", str(PROJECT / "tools" / "setup.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout, log.read_text().splitlines()


def test_setup_keeps_an_installed_torch(tmp_path):
    out, calls = _setup(tmp_path, "2.14.1+cu130")
    assert "keeping the torch already installed (2.14.1+cu130)" in out
    assert calls == ["-m pip install -e .[dev,build,pipeline]"]
    assert not any("torch" in c for c in calls)


def test_setup_installs_the_cpu_torch_only_when_none_is_importable(tmp_path):
    out, calls = _setup(tmp_path, "")
    assert "no importable torch; installing the CPU build torch==2.13.0" in out
    assert calls == ["-m pip install torch==2.13.0", "-m pip install -e .[dev,build,pipeline]"]


def _repo_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=PROJECT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [PROJECT / f for f in listed if (PROJECT / f).is_file() and not f.endswith((".png", ".pt"))]


def test_design_references_point_at_sections_that_exist():
    design = (PROJECT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\. ", design, re.M))
    refs = []
    for f in _repo_files():
        text = f.read_text(errors="replace")
        for m in re.finditer(r"docs/design\.md sections? (\d+)(?: and (\d+))?", text):
            refs += [(f.relative_to(PROJECT).as_posix(), n) for n in m.groups() if n]
    assert refs, "expected references to docs/design.md"
    missing = [r for r in refs if r[1] not in sections]
    assert not missing, f"references to sections docs/design.md does not have: {missing}"


# the needles are assembled so that this file does not contain them either (it is checked too);
# whitespace between their words may be anything, a line break and comment marks included
@pytest.mark.parametrize("needle", [r"\.\./" + "shared/", "DESIGN" + r"[\s#/*]+section"])
def test_nothing_cites_outside_the_repository(needle):
    hits = [f.relative_to(PROJECT).as_posix() for f in _repo_files() if re.search(needle, f.read_text(errors="replace"))]
    assert not hits, f"{needle} cited in {hits}"
