"""Whether the server's Python can import what SGLang imports at start, checked before any launch.

A package the live bundle lacks stops every launch at import, each after a model load's worth of
waiting, and the log names only the first missing module. This check imports the modules a
server start reaches (the HTTP server, the scheduler, the DeepSeek model and its NextN draft, the
EAGLE and NGRAM workers, the triton backend and the plugin) in one child process with the
server's interpreter and ``PYTHONPATH``. On a missing module it notes it, puts an empty stand-in in
its place and goes on, so one run names every missing package, not only the first.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

#: What ``python -m sglang.launch_server`` imports in its processes for this gate's launches
#: (SGLang 0.5.17's module names; the CUDA-graph capture imports the two attention backends).
SERVER_MODULES = (
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_loader.loader", "sglang.srt.models.deepseek_v2", "sglang.srt.models.deepseek_nextn",
    "sglang.srt.speculative.eagle_worker_v2", "sglang.srt.speculative.ngram_worker",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.attention.flashmla_backend",
    "sglang.srt.layers.attention.dsa_backend", "kdtree_engine.sglang.plugin",
)

#: Runs in the child, with the server's interpreter and path.
PROBE = Path(__file__).with_name("import_probe.py")


def check(python: str, env: dict[str, str], modules: Sequence[str] = SERVER_MODULES, *,
          cwd: Path | None = None, timeout: float = 600.0) -> list[str]:
    """One sentence per module the server cannot import (empty: all import)."""
    try:
        r = subprocess.run([python, str(PROBE), *modules], env={**os.environ, **env}, cwd=cwd,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"importing the server's modules took over {timeout:.0f}s"]
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("KDTREE_IMPORTS ")), None)
    if line is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return [f"the import check exited {r.returncode} without its result: {' | '.join(tail)}"]
    found = json.loads(line.split(" ", 1)[1])
    problems = []
    by_name: dict[str, list[str]] = {}
    for name, via in found["missing"]:
        by_name.setdefault(name.split(".")[0], []).append(via)
    if by_name:
        problems.append("the live bundle lacks " + ", ".join(
            f"{n} (imported under {', '.join(dict.fromkeys(v))})" for n, v in sorted(by_name.items()))
            + ": add the packages to tools/live_site.py and make the bundle again")
    after = " (after the stand-ins for what is missing: it may be theirs)" if by_name else ""
    problems += [f"importing {m} failed{after}: {err}" for m, err in found["failed"]]
    return problems
