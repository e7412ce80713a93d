"""``python -m kdtree_engine <gate> [args]``: run one gate and write its evidence.

Every nox gate session calls this, so a gate runs the same way with or without
nox (and with ``nox --no-venv`` on a GPU host that cannot build venvs).
"""

from __future__ import annotations

import importlib
import sys

#: gate name -> "module:function"; the function takes argv and returns an exit code.
GATES: dict[str, str] = {
    "build": "kdtree_engine.kernel.build:main",
    "oracle-selftest": "kdtree_engine.oracle.selftest:main",
    "oracle": "kdtree_engine.oracle.gate:main",
    "bench": "kdtree_engine.bench.gate:main",
    "integrate": "kdtree_engine.sglang.integrate:main",
    "smoke": "kdtree_engine.smoke.gate:main",
    "graph": "kdtree_engine.graph.gate:main",
    "defrag": "kdtree_engine.defrag.gate:main",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kdtree_engine <gate> [args]\ngates: " + ", ".join(GATES))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in GATES:
        print(f"kdtree: unknown gate {name!r}; expected one of: {', '.join(GATES)}", file=sys.stderr)
        return 2
    module, func = GATES[name].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
