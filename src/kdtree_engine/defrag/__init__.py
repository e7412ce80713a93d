"""KV defrag: move requests' scattered KV slots into contiguous runs (Phase 5).

:mod:`.compact` plans and applies a compaction of SGLang's page-size-1 pools;
its gate, ``python -m kdtree_pipeline defrag``, lives in the proof package. Nothing calls it
from SGLang's scheduler: the duck-typed adapter had no caller and was tested only on
stand-ins, so it was removed; wiring it means an entry point a scheduler step calls, tested
on SGLang's real pools and radix cache.
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
