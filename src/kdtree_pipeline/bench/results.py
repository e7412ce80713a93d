"""One timed (case, system, mask) figure, as the report and the targets read it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: ok: timed and correct; wrong: timed but its output fails the reference check;
#: unsupported: the peer cannot do this case; error: the call raised;
#: missing: the system is not importable here; skipped: the suite's time budget ran out
STATUSES = ("ok", "wrong", "unsupported", "error", "missing", "skipped")


@dataclass
class Result:
    case: str
    system: str
    mask: str
    status: str
    replay_us: float | None = None
    eager_us: float | None = None
    graph_error: str | None = None
    error: str | None = None
    check: dict[str, Any] | None = None
    rotations: int = 0
    calls: int = 0
    replay_reps: int = 0
    eager_reps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Result.status: expected one of {STATUSES}, got {self.status!r}")

    @property
    def time_us(self) -> float | None:
        """The primary figure: graph replay, else eager (a peer that could not be captured)."""
        return self.replay_us if self.replay_us is not None else self.eager_us

    @property
    def timing(self) -> str | None:
        if self.replay_us is not None:
            return "replay"
        return "eager" if self.eager_us is not None else None

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.time_us is not None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_us"] = self.time_us
        d["timing"] = self.timing
        return d


class Table:
    """Results indexed by (case, system, mask)."""

    def __init__(self, results: list[Result]):
        self.results = list(results)
        self._ix = {(r.case, r.system, r.mask): r for r in self.results}

    def get(self, case: str, system: str, mask: str) -> Result | None:
        return self._ix.get((case, system, mask))

    def time(self, case: str, system: str, mask: str) -> float | None:
        r = self.get(case, system, mask)
        return r.time_us if r is not None and r.usable else None

    def why_not(self, case: str, system: str, mask: str) -> str:
        """Why there is no usable figure (for a note)."""
        r = self.get(case, system, mask)
        if r is None:
            return f"{system} {mask}: not run"
        if r.status == "ok":
            return f"{system} {mask}: no time"
        return f"{system} {mask}: {r.status}" + (f" ({r.error[:120]})" if r.error else "")
