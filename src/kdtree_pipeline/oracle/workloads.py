"""Seeded workloads in SGLang's verify layout: draft trees and batches.

Trees are parent arrays in topological order (``parents[j] < j``, -1 for the
root), the shapes speculative decoders really run:

- ``chain``: one path (what FlashMLA and SGLang's split-KV kernel can do)
- ``star``: the root and N-1 children (one step, many candidates)
- ``eagle``: EAGLE-style top-k expansion: each level keeps the top-k scored
  children of the previous level's nodes (SGLang's --speculative-eagle-topk)
- ``deep``: a few long narrow branches
- ``best_first``: a best-first tree of a fixed node budget by cumulative draft
  probability (the DDTree method)
- ``random``: uniform random parents

A batch (:class:`Batch`) carries everything the kernel, the reference and
SGLang's Triton kernel take: a bf16 slot pool with slot 0 as SGLang's padding
slot, per-request slot ids laid out contiguously, fragmented (a random
permutation) or in runs of r slots, FULL_MASK masks (bool or uint8), and the
parent arrays the masks came from. Pool slots that no request uses are filled
with NaN so a read of a wrong slot shows up as NaN in the output.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

HEAD_DIM = 576
TREE_KINDS = ("chain", "star", "eagle", "deep", "best_first", "random")
LAYOUTS = ("contiguous", "fragmented", "runs16", "runs64", "runs256")
#: DeepSeek-V3 MLA: softmax scale of a 192-wide qk head (128 nope + 64 rope), before YaRN mscale.
DEEPSEEK_SM_SCALE = 192 ** -0.5


def chain(n: int) -> list[int]:
    return [j - 1 for j in range(n)]


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def eagle(n: int, topk: int = 4, gen: torch.Generator | None = None) -> list[int]:
    """Root, then per level: every kept node proposes ``topk`` children with
    random cumulative scores; the ``topk`` best over the level are kept."""
    if n <= 0:
        return []
    parents = [-1]
    score = [0.0]
    level = [0]
    while len(parents) < n:
        cands = []
        for node in level:
            logp = torch.rand(topk, generator=gen).log().tolist()
            cands += [(score[node] + lp, node) for lp in logp]
        cands.sort(key=lambda c: -c[0])
        level = []
        for sc, par in cands[:topk]:
            if len(parents) == n:
                break
            parents.append(par)
            score.append(sc)
            level.append(len(parents) - 1)
    return parents


def deep(n: int, branches: int = 2) -> list[int]:
    """``branches`` chains hanging from the root, filled round-robin."""
    if n <= 0:
        return []
    parents = [-1]
    tips = [0] * branches
    for j in range(1, n):
        b = (j - 1) % branches
        parents.append(tips[b])
        tips[b] = j
    return parents


def best_first(n: int, branching: int = 8, gen: torch.Generator | None = None) -> list[int]:
    """DDTree: pop the most probable frontier node (cumulative log-prob), add it,
    push its ``branching`` children with random draft probabilities."""
    if n <= 0:
        return []
    parents: list[int] = []
    heap: list[tuple[float, int, int]] = [(-0.0, 0, -1)]
    tie = 1
    while heap and len(parents) < n:
        neg, _, par = heapq.heappop(heap)
        parents.append(par)
        me = len(parents) - 1
        probs = torch.softmax(torch.randn(branching, generator=gen) * 2.0, 0).tolist()
        for p in probs:
            heapq.heappush(heap, (neg - math.log(max(p, 1e-12)), tie, me))
            tie += 1
    return parents


def random_tree(n: int, gen: torch.Generator | None = None) -> list[int]:
    return [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


def make_tree(kind: str, n: int, gen: torch.Generator | None = None) -> list[int]:
    if kind == "chain":
        return chain(n)
    if kind == "star":
        return star(n)
    if kind == "eagle":
        return eagle(n, gen=gen)
    if kind == "deep":
        return deep(n)
    if kind == "best_first":
        return best_first(n, gen=gen)
    if kind == "random":
        return random_tree(n, gen=gen)
    raise ValueError(f"tree kind: expected one of {', '.join(TREE_KINDS)}, got {kind!r}")


def check_parents(parents: Sequence[int]) -> None:
    for j, p in enumerate(parents):
        if not (p == -1 if j == 0 else -1 <= p < j):
            raise ValueError(f"parents[{j}] = {p}: drafts must be in topological order (parent < child)")


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row t sees draft j iff j is t or an ancestor of t."""
    check_parents(parents)
    n = len(parents)
    vis = torch.zeros((n, n), dtype=torch.bool)
    for t in range(n):
        if parents[t] >= 0:
            vis[t] = vis[parents[t]]
        vis[t, t] = True
    return vis


def full_mask(parents: Sequence[int], prefix_len: int) -> torch.Tensor:
    """SGLang FULL_MASK rows for one request: [N, prefix_len + N] bool, prefix all visible."""
    n = len(parents)
    m = torch.ones((n, prefix_len + n), dtype=torch.bool)
    m[:, prefix_len:] = ancestor_mask(parents)
    return m


def slot_layout(total: int, pool_slots: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """``total`` distinct slot ids in [1, pool_slots) (slot 0 is padding)."""
    if total > pool_slots - 1:
        raise ValueError(f"pool of {pool_slots} slots cannot hold {total} tokens plus the padding slot")
    if layout == "contiguous":
        return torch.arange(1, total + 1, dtype=torch.int64)
    if layout == "fragmented":
        return (torch.randperm(pool_slots - 1, generator=gen)[:total] + 1).to(torch.int64)
    if layout.startswith("runs"):
        r = int(layout[4:])
        nruns = -(-total // r)
        avail = (pool_slots - 1) // r
        if nruns > avail:
            raise ValueError(f"layout {layout}: pool too small for {nruns} runs")
        starts = torch.randperm(avail, generator=gen)[:nruns] * r + 1
        ids = (starts[:, None] + torch.arange(r)[None, :]).reshape(-1)[:total]
        return ids.to(torch.int64)
    raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")


@dataclass
class Batch:
    q: torch.Tensor
    k_ext: torch.Tensor
    kv_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    sm_scale: float
    max_n: int
    prefix_lens: list[int]
    n_drafts: list[int]
    parents: list[list[int]]
    meta: dict = field(default_factory=dict)

    @property
    def bs(self) -> int:
        return len(self.prefix_lens)

    def kernel_args(self) -> tuple:
        return (self.q, self.k_ext, self.kv_buffer, self.qo_indptr, self.kv_indptr, self.kv_indices,
                self.custom_mask, self.mask_indptr, self.sm_scale, self.max_n)

    def ref_args(self) -> tuple:
        return (self.q, self.k_ext, self.kv_buffer, self.qo_indptr, self.kv_indptr, self.kv_indices,
                self.custom_mask, self.mask_indptr, self.sm_scale)

    def to(self, device: torch.device | str) -> Batch:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**moved)


def make_batch(
    prefix_lens: Sequence[int],
    n_drafts: Sequence[int] | int,
    num_heads: int,
    *,
    tree: str | Sequence[str] = "eagle",
    layout: str = "fragmented",
    mask_dtype: torch.dtype = torch.uint8,
    sm_scale: float = DEEPSEEK_SM_SCALE,
    seed: int = 0,
    device: torch.device | str = "cpu",
    spare_slots: int = 64,
    poison_unused: bool = True,
    index_dtype: torch.dtype = torch.int64,
    max_n: int | None = None,
) -> Batch:
    """A random verify batch in SGLang's layout (values ~ N(0, 1) in bf16)."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    ns = [int(n_drafts)] * bs if isinstance(n_drafts, int) else [int(n) for n in n_drafts]
    if len(ns) != bs:
        raise ValueError(f"n_drafts: expected {bs} values (one per request), got {len(ns)}")
    kinds = [tree] * bs if isinstance(tree, str) else list(tree)
    parents = [make_tree(kinds[b % len(kinds)], ns[b], gen) for b in range(bs)]
    T = sum(ns)
    total_prefix = sum(prefix_lens)
    pool_slots = 1 + total_prefix + spare_slots
    if layout.startswith("runs"):
        r = int(layout[4:])
        pool_slots = 1 + r * (2 * (-(-total_prefix // r)) + 1) + spare_slots
    elif layout == "fragmented":
        pool_slots = 1 + total_prefix + max(spare_slots, total_prefix // 4)
    slots = slot_layout(total_prefix, pool_slots, layout, gen)

    kv_buffer = torch.randn((pool_slots, 1, HEAD_DIM), generator=gen).to(torch.bfloat16)
    if poison_unused:
        used = torch.zeros(pool_slots, dtype=torch.bool)
        used[slots] = True
        kv_buffer[~used] = float("nan")
    q = torch.randn((T, num_heads, HEAD_DIM), generator=gen).to(torch.bfloat16)
    k_ext = torch.randn((T, 1, HEAD_DIM), generator=gen).to(torch.bfloat16)

    qo = [0]
    kv = [0]
    mi = [0]
    masks = []
    for b in range(bs):
        qo.append(qo[-1] + ns[b])
        kv.append(kv[-1] + prefix_lens[b])
        m = full_mask(parents[b], prefix_lens[b])
        masks.append(m.reshape(-1))
        mi.append(mi[-1] + m.numel())
    custom_mask = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
    batch = Batch(
        q=q,
        k_ext=k_ext,
        kv_buffer=kv_buffer,
        qo_indptr=torch.tensor(qo, dtype=torch.int32),
        kv_indptr=torch.tensor(kv, dtype=torch.int32),
        kv_indices=slots.to(index_dtype),
        custom_mask=custom_mask.to(mask_dtype),
        mask_indptr=torch.tensor(mi, dtype=torch.int64),
        sm_scale=float(sm_scale),
        max_n=max(ns, default=0) if max_n is None else max_n,
        prefix_lens=list(prefix_lens),
        n_drafts=ns,
        parents=parents,
        meta={"tree": kinds, "layout": layout, "seed": seed, "mask_dtype": str(mask_dtype)},
    )
    return batch.to(device) if str(device) != "cpu" else batch
