"""KV defrag: move requests' scattered KV slots into contiguous runs (Phase 5).

:mod:`.compact` plans and applies a compaction of SGLang's page-size-1 pools;
:mod:`.gate` is ``python -m kdtree_pipeline defrag``. Nothing calls it from SGLang's
scheduler: the unwired duck-typed adapter was removed (issue 18); wiring it means an
entry point a scheduler step calls, tested on SGLang's real pools and radix cache.
"""

from kdtree_engine.defrag.compact import (
    DefragError,
    DefragInputError,
    DefragPlan,
    DefragResult,
    NotEnoughFreeSlotsError,
    apply_plan,
    contiguous_runs,
    count_runs,
    defrag,
    plan_defrag,
)

__all__ = [
    "DefragError",
    "DefragInputError",
    "DefragPlan",
    "DefragResult",
    "NotEnoughFreeSlotsError",
    "apply_plan",
    "contiguous_runs",
    "count_runs",
    "defrag",
    "plan_defrag",
]
