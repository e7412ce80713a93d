"""tools/gpu_session.sh, which spends GPU time when it is wrong: it parses, and its usage
lines name exactly the steps it runs and the variables it reads (CPU)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


def test_usage_lists_exactly_the_variables_it_reads():
    text = SCRIPT.read_text()
    read = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)(?::[-+])", text))
    documented = _header(text, "env")
    missing = read - {"OUT"} - documented  # OUT: set by the device tool
    assert read and not missing, f"undocumented: {sorted(missing)}"
    # and the other way: a variable the usage names that no step reads any more
    named = {w for w in documented if re.fullmatch(r"[A-Z][A-Z0-9_]+", w)}
    assert named and not named - read, f"documented but never read: {sorted(named - read)}"


def test_each_invocation_starts_with_empty_evidence_and_reports():
    """A warm device keeps /tmp between calls: the script must empty the folders it
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
