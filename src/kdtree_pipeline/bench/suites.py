"""Bench suites: which shapes are timed, on which masks, with which systems.

A :class:`Case` is one verify call shape: ``bs`` requests of ``n`` drafts and
``heads`` query heads over a prefix of ``prefix`` cached tokens each, with the
slots laid out as ``layout`` (see :mod:`kdtree_pipeline.oracle.workloads`). A
*ragged* case (:meth:`Case.ragged`) gives each request its own prefix length
(``prefixes``); its ``prefix`` is then the longest of them, the host hint
``max_prefix_len`` that ours is called with.
Every case is run with a tree mask (``eagle``) and/or a chain mask; SGLang's
split-KV kernel and FlashMLA only run chains, SGLang's extend kernel runs the
tree (its time does not depend on the mask).

Suites (docs/design.md section 6):

- ``micro``: the 13 shapes of the docs/design.md section 6 table (Phase 1),
  bs=1, N=16, H=8 at prefix 1k and 4k called as under CUDA-graph capture, without
  the host hint (``-nohint``: the device picks the splits), and the ragged batches
  (:data:`RAGGED_CASES`: one long request among short ones, where the split schedule
  matters most).
- ``long-context``: bs=1, H=8, N=16 and 64, prefix 23k..91k (Phase 3).
- ``fragmentation``: one request (bs=1, H=8, N=16, tree) with its slot ids
  contiguous, in runs of 16/64/256 and fully random, prefix 4k..91k: the
  penalty of each layout against contiguous.
- ``graph``: the owned kernel eager vs CUDA-graph replay at prefix 1k and 64k,
  bs 1 and 32: what capture saves a verify call.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field


def length_counts(prefixes: Sequence[int]) -> list[tuple[int, int]]:
    """(length, requests of that length) of a batch's prefix lengths, longest first: what a
    ragged case's name (Case.ragged_label) and a report's prefix column (report.prefix_text) print."""
    return sorted(Counter(prefixes).items(), reverse=True)


def prefix_lens_of(bs: int, prefix: int, prefixes: Sequence[int] | None) -> tuple[int, ...]:
    """Every request's prefix length, in batch order: ``prefixes`` for a ragged batch, else
    ``prefix`` for each of the ``bs`` requests (Case.prefix_lens; a report's case dicts)."""
    return tuple(prefixes) if prefixes is not None else (prefix,) * bs


#: every system the bench knows, in table order. ``ours-sm120`` is the owned kernel in
#: the sm_120 emulation (``target="sm_120"``): the kernel and tile an RTX PRO 6000
#: Blackwell runs, under its limits, on the GPU at hand (no sm_120 GPU is available here)
SYSTEMS = ("ours", "ours-sm120", "sglang-extend", "sglang-splitkv", "flashmla")
#: systems ``--systems`` may name that no suite runs by default: ``ours-make`` is ``ours`` with
#: the step plan made in every call (the step's first layer; bench.peers)
EXTRA_SYSTEMS = ("ours-make",)
MASKS = ("tree", "chain")
FRAG_LAYOUTS = ("contiguous", "runs256", "runs64", "runs16", "fragmented")


@dataclass(frozen=True)
class Case:
    """One verify shape. ``n`` is drafts per request (the T column of docs/design.md section 6).
    ``hint`` False: the owned kernel is called without the ``max_prefix_len`` host hint, as
    the SGLang plugin calls it under CUDA-graph capture (the grid then takes the GPU-filling
    split count and the device trims it per request); the peers run as always.

    ``prefixes``: a ragged batch, one prefix length per request (``bs`` of them, not all
    equal); ``prefix`` is then the longest (what ours gets as ``max_prefix_len``, and what
    the targets' prefix selectors see). Build one with :meth:`ragged`. ``label`` names it
    (``bs8-N16-H8-ragged-one64k-seven1k``); without one the name spells the lengths
    (``bs8-N16-H8-ragged-1x65536-7x1024``). :attr:`prefix_lens` is every request's length
    either way: what the batch builder, the floor and the peers use."""

    bs: int
    n: int
    heads: int
    prefix: int
    layout: str = "fragmented"
    masks: tuple[str, ...] = MASKS
    tree: str = "eagle"
    hint: bool = True
    prefixes: tuple[int, ...] | None = None
    label: str | None = None

    @classmethod
    def ragged(cls, n: int, heads: int, prefixes: Sequence[int], label: str | None = None, **kw) -> Case:
        """A ragged batch: one request per entry of ``prefixes``, ``prefix`` the longest."""
        lens = tuple(int(x) for x in prefixes)
        return cls(len(lens), n, heads, max(lens, default=0), prefixes=lens, label=label, **kw)

    def __post_init__(self) -> None:
        for name in ("bs", "n", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"Case.{name}: expected >= 1, got {getattr(self, name)}")
        if self.prefix < 0:
            raise ValueError(f"Case.prefix: expected >= 0, got {self.prefix}")
        bad = [m for m in self.masks if m not in MASKS]
        if bad or not self.masks:
            raise ValueError(f"Case.masks: expected a non-empty subset of {MASKS}, got {self.masks}")
        if self.prefixes is None:
            if self.label is not None:
                raise ValueError(f"Case.label: expected only with Case.prefixes (a ragged case), got {self.label!r}")
            return
        lens = self.prefixes
        if not isinstance(lens, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) for x in lens):
            raise ValueError(f"Case.prefixes: expected a tuple of ints (one prefix length per request), got {lens!r}")
        if len(lens) != self.bs:
            raise ValueError(f"Case.prefixes: expected {self.bs} prefix lengths (one per request, bs = {self.bs}), "
                             f"got {len(lens)}")
        if min(lens) < 0:
            raise ValueError(f"Case.prefixes: expected lengths >= 0, got {lens}")
        if len(set(lens)) < 2:
            raise ValueError(f"Case.prefixes: expected lengths that differ (a batch of one length is "
                             f"Case(bs, n, heads, prefix) without prefixes), got {lens}")
        if self.prefix != max(lens):
            raise ValueError(f"Case.prefix: expected the longest of Case.prefixes ({max(lens)}) for a ragged case, "
                             f"got {self.prefix}")
        if self.label is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.label):
            raise ValueError(f"Case.label: expected letters, digits, '.', '_' or '-' (it is part of the case "
                             f"name), got {self.label!r}")

    @property
    def is_ragged(self) -> bool:
        return self.prefixes is not None

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        """Every request's prefix length, in batch order."""
        return prefix_lens_of(self.bs, self.prefix, self.prefixes)

    @property
    def total_prefix(self) -> int:
        return sum(self.prefix_lens)

    @property
    def shape(self) -> tuple[int, int, int, tuple[int, ...]]:
        """(bs, n, heads, per-request prefixes): what differs between requests, not the slot layout."""
        return self.bs, self.n, self.heads, self.prefix_lens

    @property
    def ragged_label(self) -> str | None:
        """The ragged part of the name: ``label``, else the lengths as COUNTxLEN, longest first."""
        if self.prefixes is None:
            return None
        if self.label is not None:
            return self.label
        return "-".join(f"{k}x{v}" for v, k in length_counts(self.prefixes))

    def _tagged(self, base: str, sep: str) -> str:
        base = base if self.layout == "fragmented" else f"{base}{sep}{self.layout}"
        return base if self.hint else f"{base}{sep}nohint"

    @property
    def name(self) -> str:
        size = f"ragged-{self.ragged_label}" if self.is_ragged else f"L{self.prefix}"
        return self._tagged(f"bs{self.bs}-N{self.n}-H{self.heads}-{size}", "-")

    @property
    def series(self) -> str:
        """The case without its prefix: points of one series differ only in prefix. A ragged
        case is a series of its own (its lengths are its shape, not a point on a prefix axis)."""
        base = f"bs{self.bs} N{self.n} H{self.heads}"
        return self._tagged(f"{base} ragged {self.ragged_label}" if self.is_ragged else base, " ")

    @property
    def tokens(self) -> int:
        return self.bs * self.n

    @property
    def rows(self) -> int:
        """(draft, head) rows of the whole batch."""
        return self.bs * self.n * self.heads


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    cases: tuple[Case, ...]
    #: systems run by default (``--systems`` narrows it)
    systems: tuple[str, ...]
    #: the targets evaluated on this suite (names from :mod:`kdtree_pipeline.bench.targets`; one
    #: whose ``Spec.reported`` is set is shown, met or missed, and does not decide the gate)
    targets: tuple[str, ...]
    #: wall-clock budget of the whole suite in seconds; cases past it are skipped (and fail the gate)
    budget_s: float
    kind: str = "compare"  # compare | fragmentation | graph (selects the report layout)
    notes: tuple[str, ...] = field(default_factory=tuple)


#: docs/design.md section 6: (bs, N, H, prefix)
MICRO_SHAPES = (
    (1, 16, 8, 4096), (1, 16, 8, 23000), (1, 16, 8, 65536), (1, 16, 8, 91000),
    (1, 16, 64, 32768), (8, 16, 8, 32768), (32, 8, 16, 8192), (64, 4, 16, 4096),
    (64, 4, 16, 16384), (16, 8, 128, 8192), (1, 4, 128, 65536), (1, 64, 8, 65536),
    (4, 32, 16, 32768),
)
LONG_PREFIXES = (23000, 32768, 49152, 65536, 91000)
FRAG_PREFIXES = (4096, 23000, 65536, 91000)
GRAPH_PREFIXES = (1024, 65536)
#: bs=1, N=16, H=8 at these prefixes without the host hint, as SGLang calls under CUDA-graph
#: capture (micro suite)
NOHINT_PREFIXES = (1024, 4096)
#: ragged batches (micro suite): (label, N, H, per-request prefixes). One long request among
#: short ones is where the split schedule matters: ours splits each request by its own length,
#: FlashMLA cuts the batch's work into equal parts per SM.
RAGGED_CASES = (
    ("one64k-seven1k", 16, 8, (65536,) + (1024,) * 7),
    ("geometric32k", 16, 8, tuple(32768 >> i for i in range(8))),
    ("one91k-three4k", 16, 8, (91000, 4096, 4096, 4096)),
    ("one32k-rest2k", 8, 16, (32768,) + (2048,) * 31),
    ("two64k-rest1k", 16, 8, (65536, 65536) + (1024,) * 14),
)

#: the shape of the floor-fraction target: bs=1, H=8, N=16, prefix 65536
FLOOR_SHAPE = (1, 16, 8, 65536)
#: prefix from which the 50x-over-SGLang-extend target applies (uniform cases only: a ragged
#: batch is not a long-context call, bench/targets.py)
EXTEND_TARGET_MIN_PREFIX = 23000
#: the sm_120 seed shapes: bs=1, N=16, H=8 at prefixes 23k..91k (sm_120 within 2.0x of the Hopper kernel)
SM120_SEED = (1, 16, 8)
SM120_SEED_PREFIXES = (23000, 91000)

SUITES: dict[str, Suite] = {
    "micro": Suite(
        "micro",
        "Phase 1: the docs/design.md section 6 shapes, tree and chain, every peer "
        "(and bs1 N16 H8 1k, 4k without the host hint; ragged batches of one long request among short ones)",
        tuple(Case(bs, n, h, L) for bs, n, h, L in MICRO_SHAPES)
        + tuple(Case(1, 16, 8, L, hint=False) for L in NOHINT_PREFIXES)
        + tuple(Case.ragged(n, h, lens, label) for label, n, h, lens in RAGGED_CASES),
        SYSTEMS,
        ("splitkv", "flashmla", "tree_vs_chain", "floor_fraction", "sm120_seed", "sm120_hopper", "sm120_splitkv"),
        budget_s=360.0,
    ),
    "long-context": Suite(
        "long-context",
        "Phase 3: bs=1, H=8, N=16 and 64, prefix 23k..91k, tree and chain, every peer",
        tuple(Case(1, n, 8, L) for n in (16, 64) for L in LONG_PREFIXES),
        SYSTEMS,
        ("extend_50x", "splitkv", "flashmla", "tree_vs_chain", "floor_fraction", "sm120_seed", "sm120_hopper",
         "sm120_extend_50x"),
        budget_s=360.0,
    ),
    "fragmentation": Suite(
        "fragmentation",
        "Fragmentation: one request's slot ids contiguous / runs of 256, 64, 16 / random, prefix 4k..91k",
        tuple(Case(1, 16, 8, L, layout=lay, masks=("tree",)) for L in FRAG_PREFIXES for lay in FRAG_LAYOUTS),
        ("ours", "ours-sm120", "sglang-extend"),
        ("fragmentation", "sm120_fragmentation"),
        budget_s=360.0,
        kind="fragmentation",
    ),
    "graph": Suite(
        "graph",
        "Graph capture: the owned kernel eager vs CUDA-graph replay per verify call, prefix 1k and 64k, bs 1 and 32",
        tuple(Case(bs, 16, 8, L, masks=("tree",)) for bs in (1, 32) for L in GRAPH_PREFIXES),
        ("ours",),
        (),
        budget_s=180.0,
        kind="graph",
    ),
}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ValueError(f"--suite: expected one of {', '.join(SUITES)}, got {name!r}")
    return SUITES[name]


def parse_systems(text: str | None, suite: Suite) -> tuple[str, ...]:
    """``--systems`` (comma list) -> the systems to run, in table order; None -> the suite's default."""
    if text is None:
        return suite.systems
    want = [s.strip() for s in text.split(",") if s.strip()]
    known = SYSTEMS + EXTRA_SYSTEMS
    if not want:
        raise ValueError(f"--systems: expected a comma list of {', '.join(known)}, got {text!r}")
    bad = [s for s in want if s not in known]
    if bad:
        raise ValueError(f"--systems: unknown system(s) {', '.join(bad)}; expected some of {', '.join(known)}")
    return tuple(s for s in known if s in want)
