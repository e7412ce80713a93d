"""Input sets of one bench case, generated on the device.

A case is timed over ``R`` independent input sets (own KV pool, q, k_ext) so
that repeated calls do not measure the L2 cache: ``R`` is chosen so that the
sets together hold about three times the L2 size (METHOD: rotate among several
input sets when they fit in the cache). Values are bf16 N(0, 1), never zeros.

The layout pieces (draft trees, FULL_MASK masks, slot layouts, pool sizes) come
from :mod:`kdtree_pipeline.oracle.workloads`; only the bulk random tensors are
drawn here, directly on the device, because drawing gigabytes on the host is
slow. The slot ids, indptrs and masks are shared by the sets of a case (they
are small); each set has its own tensors for the data.

Every set of a case holds the *same request* whatever the layout: the logical
prefix KV (token i of request b), q and k_ext come from a seed that does not
depend on the layout, and are scattered into the pool at the layout's slots.
Unused pool slots hold random filler (a live pool holds stale KV, not NaN).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from kdtree_pipeline.bench.roofline import case_bytes
from kdtree_pipeline.bench.suites import Case
from kdtree_pipeline.oracle import workloads

HEAD_DIM = workloads.HEAD_DIM
DEFAULT_L2_BYTES = 60 * 2**20
MAX_ROTATIONS = 128


def rotations(case: Case, l2_bytes: int = DEFAULT_L2_BYTES, factor: float = 3.0,
              max_sets: int = MAX_ROTATIONS) -> int:
    """How many independent input sets to rotate through: enough to hold
    ``factor`` x L2 bytes, at least 1, at most ``max_sets``."""
    need = math.ceil(factor * l2_bytes / max(1, case_bytes(case)))
    return max(1, min(max_sets, need))


def pool_slots(total_prefix: int, layout: str, spare: int = 64) -> int:
    """The pool size :func:`workloads.make_batch` uses for a layout."""
    if layout.startswith("runs"):
        r = int(layout[4:])
        return 1 + r * (2 * (-(-total_prefix // r)) + 1) + spare
    if layout == "fragmented":
        return 1 + total_prefix + max(spare, total_prefix // 4)
    return 1 + total_prefix + spare


@dataclasses.dataclass
class CaseSet:
    """One input set of a case: a tree batch and a chain batch sharing the data tensors."""

    batches: dict[str, workloads.Batch]

    def batch(self, mask: str) -> workloads.Batch:
        if mask not in self.batches:
            raise KeyError(f"mask {mask!r} not built for this case (built: {', '.join(self.batches)})")
        return self.batches[mask]


def _masks(parents: list[list[int]], lens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The FULL_MASK rows of every request (request b over its own prefix ``lens[b]``) and their indptr."""
    rows = [workloads.full_mask(p, L).reshape(-1) for p, L in zip(parents, lens, strict=True)]
    mask = torch.cat(rows)
    indptr = [0]
    for r in rows:
        indptr.append(indptr[-1] + r.numel())
    return mask, torch.tensor(indptr, dtype=torch.int64)


def build_sets(case: Case, count: int, device: torch.device | str, seed: int = 0,
               sm_scale: float = workloads.DEEPSEEK_SM_SCALE) -> list[CaseSet]:
    """``count`` input sets of ``case`` on ``device`` (each mask of ``case.masks``). Request b
    has ``case.prefix_lens[b]`` prefix tokens (all ``case.prefix`` but in a ragged case): its
    slots are ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``."""
    if count < 1:
        raise ValueError(f"count: expected >= 1 input sets, got {count}")
    device = torch.device(device)
    bs, n, h, lens = case.bs, case.n, case.heads, case.prefix_lens
    # structure (host, small): trees, masks, slot layout; shared by the sets
    tree_gen = torch.Generator().manual_seed(seed * 7919 + 1)
    parents = {"tree": [workloads.make_tree(case.tree, n, tree_gen) for _ in range(bs)],
               "chain": [workloads.chain(n) for _ in range(bs)]}
    total = sum(lens)
    slots_n = pool_slots(total, case.layout)
    layout_gen = torch.Generator().manual_seed(seed * 7919 + 2 + sum(map(ord, case.layout)))
    slots = workloads.slot_layout(total, slots_n, case.layout, layout_gen).to(device)
    qo = (torch.arange(bs + 1, dtype=torch.int32) * n).to(device)
    kv = torch.tensor((0, *itertools.accumulate(lens)), dtype=torch.int32).to(device)
    masks = {}
    for m in case.masks:
        mk, mi = _masks(parents[m], lens)
        masks[m] = (mk.to(device), mi.to(device))

    sets = []
    for i in range(count):
        # data (device, bulk): the same request whatever the layout
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i * 7 + 3)
        fill = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i * 7 + 4)
        pool = torch.randn((slots_n, 1, HEAD_DIM), generator=fill, device=device, dtype=torch.bfloat16)
        if total:
            logical = torch.randn((total, HEAD_DIM), generator=g, device=device, dtype=torch.bfloat16)
            pool[slots, 0] = logical
        q = torch.randn((bs * n, h, HEAD_DIM), generator=g, device=device, dtype=torch.bfloat16)
        k_ext = torch.randn((bs * n, 1, HEAD_DIM), generator=g, device=device, dtype=torch.bfloat16)
        batches = {}
        for m in case.masks:
            mk, mi = masks[m]
            batches[m] = workloads.Batch(
                q=q, k_ext=k_ext, kv_buffer=pool, qo_indptr=qo, kv_indptr=kv, kv_indices=slots,
                custom_mask=mk, mask_indptr=mi, sm_scale=float(sm_scale), max_n=n,
                prefix_lens=list(lens), n_drafts=[n] * bs, parents=parents[m],
                meta={"tree": case.tree if m == "tree" else "chain", "layout": case.layout, "set": i,
                      "hint": case.hint},
            )
        sets.append(CaseSet(batches))
    return sets
