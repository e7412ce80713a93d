"""README's two commands and set-up facts hold, its other commands name tasks, sessions,
steps and switches that exist, it stays under 200 lines, the set-up script keeps an
installed torch, and the repository's references point into its own design document
(CPU, no network: a stand-in python records what the script would install)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
README = PROJECT / "README.md"
#: the two commands a fresh machine runs, first in README, each after one line saying what it does
SETUP_COMMAND = "bash tools/setup.sh && invoke phase0"
TEST_COMMAND = "python3 -m pip install nox && nox -s tests"
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


def _readme_code() -> list[str]:
    """README's command text: its indented code lines and its inline code spans."""
    text = README.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("    ") and ln.strip()]
    return lines + re.findall(r"`([^`\n]+)`", text)


def test_readme_is_under_200_lines():
    n = len(README.read_text().splitlines())
    assert n < 200, f"README.md has {n} lines; the rest belongs in docs/"


def test_readme_opens_with_the_two_commands_each_after_what_it_does():
    lines = README.read_text().splitlines()
    code = [i for i, ln in enumerate(lines) if ln.startswith("    ") and ln.strip()]
    assert [lines[i].strip() for i in code[:2]] == [SETUP_COMMAND, TEST_COMMAND]
    assert code[0] < next(i for i, ln in enumerate(lines) if ln.startswith("## ")), "the commands come first"
    for i in code[:2]:
        assert lines[i - 1] == "" and lines[i - 2].strip() and not lines[i - 2].startswith(("#", "    "))
    # CI runs README's test command itself
    ci = (PROJECT / ".ci" / "run").read_text().splitlines()
    assert TEST_COMMAND.split(" && ")[-1] in [ln.strip() for ln in ci]


def test_readme_setup_facts_are_the_scripts(tmp_path):
    """What README says tools/setup.sh installs (the CPU torch pin, the extras, the variable
    that picks another pin) is what the script does."""
    out, calls = _setup(tmp_path, "")
    pin = re.search(r"install (torch==\S+)$", calls[0]).group(1)
    extras = re.search(r"-e \.\[([a-z,]+)\]$", calls[-1]).group(1).split(",")
    readme = README.read_text()
    assert f"`{pin}`" in readme
    assert all(f"`{e}`" in readme for e in extras), extras
    assert "KDTREE_TORCH_PIN" in readme and "KDTREE_TORCH_PIN" in (PROJECT / "tools" / "setup.sh").read_text()


def _nox_sessions() -> set[str]:
    text = (PROJECT / "noxfile.py").read_text()
    names = set()
    for deco, func in re.findall(r"@nox\.session(\([^)]*\))?\s*\n(?:@[^\n]*\n)*def (\w+)", text):
        m = re.search(r'name="([^"]+)"', deco)
        names.add(m.group(1) if m else func)
    return names


def _invoke_tasks() -> set[str]:
    return set(re.findall(r"^def ([a-z]\w*)\(c: Context", (PROJECT / "tasks.py").read_text(), re.M))


def _gpu_steps() -> set[str]:
    return set(re.findall(r"^    ([a-z0-9-]+)\)", (PROJECT / "tools" / "gpu_session.sh").read_text(), re.M))


def test_readme_commands_name_tasks_sessions_and_steps_that_exist():
    code = _readme_code()
    tasks, sessions, steps = _invoke_tasks(), _nox_sessions(), _gpu_steps()
    assert {"phase0", "status", "record"} <= tasks and "tests" in sessions and "oracle" in steps
    named_tasks = {t for c in code for t in re.findall(r"\binvoke ([a-z][a-zA-Z0-9]*)", c)}
    # "phaseN" stands for any phase's task
    assert named_tasks and not {t for t in named_tasks if t != "phaseN"} - tasks, named_tasks - tasks
    named_sessions = set()
    for c in code:
        for m in re.finditer(r"\bnox -s ((?:[a-z][a-z-]*\s*)+)", c):
            named_sessions |= set(m.group(1).split())
    assert named_sessions and not named_sessions - sessions, named_sessions - sessions
    named_steps = set()
    for c in code:
        m = re.search(r"tools/gpu_session\.sh <sha> ([a-z0-9 -]+)", c)
        if m:
            named_steps |= set(m.group(1).split())
    assert named_steps and not named_steps - steps, named_steps - steps


def test_readme_switches_are_read_by_the_code():
    """Every KDTREE_* variable README names is read somewhere in src/, csrc/ or tools/."""
    named = set(re.findall(r"\bKDTREE_[A-Z0-9_]+", README.read_text()))
    code = "".join(p.read_text() for d in ("src", "csrc", "tools") for p in (PROJECT / d).rglob("*")
                   if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".cc", ".h", ".sh"))
    assert {"KDTREE_VERIFY", "KDTREE_TARGET", "KDTREE_TMA"} <= named
    assert not {v for v in named if v not in code}, named
