"""KV defrag: move requests' scattered KV slots into contiguous runs (Phase 5).

:mod:`.compact` plans and applies a compaction of SGLang's page-size-1 pools;
:mod:`.sglang_adapter` collects the slot ids SGLang keeps elsewhere (radix
tree, allocator); :mod:`.gate` is ``python -m kdtree_engine defrag``.
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
