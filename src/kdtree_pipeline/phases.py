"""The phase -> gates table (docs/design.md section 3).

One name per idea: a gate's ``session`` is the nox session that runs it, its
``stem`` the evidence file (``<stem>.json``) and the plan row. A gate with a
``variant`` (the bench suites) passes ``--suite <variant>`` to its session.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Per gate, the libraries it computes its result with: the entries of an evidence record's
#: ``versions`` (kdtree_pipeline.evidence.versions) that are part of what the gate proved. The
#: others describe the machine it happened to run on: a fresh clone's gate venv has no sglang or
#: triton, and the build gate (nvcc) or the reference self-test (torch) is the same proof without
#: them. The Python version changes no figure a gate computes. A gate not listed here counts every
#: version (the safe side for a new gate).
VERSIONS_USED: dict[str, tuple[str, ...]] = {
    "build": ("nvcc",),
    "oracle-selftest": ("torch",),
    "oracle": ("torch", "cuda"),
    "bench": ("torch", "cuda", "triton", "sglang"),  # its peers are SGLang's triton kernels
    "integrate": ("torch", "cuda", "triton", "sglang"),  # SGLang's TritonAttnBackend, plugin on vs off
    "smoke": ("torch", "cuda", "triton", "sglang"),
    "graph": ("torch", "cuda"),
    "defrag": ("torch", "cuda"),
}


def versions_used(gate: str, versions: dict[str, str | None]) -> dict[str, str]:
    """The versions ``gate`` computes with (:data:`VERSIONS_USED`), sorted by name, without
    the libraries that are absent (None or empty)."""
    used = VERSIONS_USED.get(gate)
    return {k: v for k, v in sorted(versions.items()) if v and (used is None or k in used)}


def record_name(gate: str, variant: str | None = None) -> str:
    """``oracle`` -> ``oracle``; (``bench``, ``micro``) -> ``bench-micro``: the evidence file stem."""
    return f"{gate}-{variant}" if variant else gate


class PhaseError(ValueError):
    """An unknown phase number or gate name."""


@dataclass(frozen=True)
class Gate:
    """One gate of a phase: what nox runs and which evidence file it leaves."""

    gate: str
    args: tuple[str, ...] = ()
    variant: str | None = None
    needs_gpu: bool = True

    @property
    def session(self) -> str:
        """The nox session (``nox -s <session>``); the same name as the gate."""
        return self.gate

    @property
    def stem(self) -> str:
        """The evidence file stem and plan row name, e.g. ``bench-micro``."""
        return record_name(self.gate, self.variant)

    def nox_args(self, *, no_venv: bool = False) -> list[str]:
        """The arguments after ``nox``: ``-s <session> [--no-venv] [-- <args>]``."""
        cmd = ["-s", self.session]
        if no_venv:
            cmd.append("--no-venv")
        if self.args:
            cmd += ["--", *self.args]
        return cmd


@dataclass(frozen=True)
class Phase:
    """A phase: its number, a short title (used in ``remaining = ...``), its goal
    and the gates it must pass, in order."""

    number: int
    title: str
    goal: str
    gates: tuple[Gate, ...]

    @property
    def needs_gpu(self) -> bool:
        return any(g.needs_gpu for g in self.gates)

    @property
    def gpu_gates(self) -> list[str]:
        return [g.stem for g in self.gates if g.needs_gpu]

    def gate(self, stem: str) -> Gate:
        """The gate of this phase whose evidence stem is ``stem``."""
        for g in self.gates:
            if g.stem == stem:
                return g
        raise PhaseError(
            f"gate {stem!r} is not part of phase {self.number}; "
            f"expected one of: {', '.join(g.stem for g in self.gates)}"
        )


def _bench(suite: str) -> Gate:
    return Gate("bench", ("--suite", suite), variant=suite)


PHASES: tuple[Phase, ...] = (
    Phase(
        0,
        "build + oracle baseline",
        "Build infrastructure and oracle baseline: the kernel compiles with nvcc for every "
        "target arch, and the fp32 reference agrees with an independent formulation and "
        "its golden vectors.",
        (Gate("build", needs_gpu=False), Gate("oracle-selftest", needs_gpu=False)),
    ),
    Phase(
        1,
        "kernel in isolation",
        "The owned kernel is right and fast in isolation: kernel vs fp32 reference over "
        "the shape matrix, and the micro benchmark against SGLang and FlashMLA.",
        (Gate("build", needs_gpu=False), Gate("oracle"), _bench("micro")),
    ),
    Phase(
        2,
        "sglang integration",
        "Integrated into SGLang with paged bf16 KV: oracle on SGLang layouts, and the real "
        "TritonAttnBackend in TARGET_VERIFY with the plugin on vs off.",
        (Gate("oracle"), Gate("integrate")),
    ),
    Phase(
        3,
        "long-context performance + smoke",
        "Performance validated at long context (23k..91k, eager) and a live service smoke "
        "test through the plugin.",
        (_bench("long-context"), Gate("smoke")),
    ),
    Phase(
        4,
        "cuda-graph safety",
        "CUDA-graph safety: capture and replay with changing metadata equals eager.",
        (Gate("graph"),),
    ),
    Phase(
        5,
        "defrag",
        "KV defrag: compaction is correct; fragmented vs compact cost measured.",
        (Gate("defrag"),),
    ),
)


def phase(number: int | str) -> Phase:
    """The phase numbered ``number`` (0-5); :class:`PhaseError` otherwise."""
    try:
        n = int(number)
    except (TypeError, ValueError):
        n = None
    if n is None or not 0 <= n < len(PHASES) or str(number).strip() != str(n):
        raise PhaseError(
            f"unknown phase {number!r}: expected a number from 0 to {len(PHASES) - 1}"
        )
    return PHASES[n]


def all_gate_stems() -> list[str]:
    """Every gate stem of every phase, first appearance order."""
    seen: list[str] = []
    for p in PHASES:
        for g in p.gates:
            if g.stem not in seen:
                seen.append(g.stem)
    return seen
