"""``python -m kdtree_pipeline <gate> [args]``: run one gate and write its evidence.

Every nox gate session calls this, so a gate runs the same way with or without
nox (and with ``nox --no-venv`` on a GPU host that cannot build venvs). A
gate's arguments are checked first (:func:`check_args`), before any GPU or
server is looked for; nox's gate sessions call the same check.
"""

from __future__ import annotations

import importlib
import sys

#: gate name -> "module:function"; the function takes argv and returns an exit code.
GATES: dict[str, str] = {
    "build": "kdtree_pipeline.build:main",
    "oracle-selftest": "kdtree_pipeline.oracle.selftest:main",
    "oracle": "kdtree_pipeline.oracle.gate:main",
    "bench": "kdtree_pipeline.bench.gate:main",
    "integrate": "kdtree_pipeline.integrate:main",
    "smoke": "kdtree_pipeline.smoke.gate:main",
    "graph": "kdtree_pipeline.graph.gate:main",
    "defrag": "kdtree_pipeline.defrag:main",
}

#: gate name -> "module:function" that checks its arguments without a GPU, files or
#: a server and returns what is wrong (None when nothing is).
CHECKS: dict[str, str] = {
    "bench": "kdtree_pipeline.bench.gate:check_args",
}


def check_args(name: str, argv: list[str]) -> str | None:
    """What is wrong with ``python -m kdtree_pipeline <name> <argv>``, or None: the gate
    name, then the gate's own arguments (a bench suite or system named in
    :mod:`kdtree_pipeline.bench.suites`). Pure: reads no device, writes nothing."""
    if name not in GATES:
        return f"unknown gate {name!r}; expected one of: {', '.join(GATES)}"
    spec = CHECKS.get(name)
    if spec is None:
        return None
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)(list(argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kdtree_pipeline <gate> [args]\ngates: " + ", ".join(GATES))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    problem = check_args(name, rest)
    if problem:
        prefix = f"kdtree {name}" if name in GATES else "kdtree"
        print(f"{prefix}: {problem}", file=sys.stderr)
        return 2
    module, func = GATES[name].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
