"""KV-pool compaction for SGLang's page-size-1 MLA layout.

SGLang keeps, per layer, one pool ``kv_buffer[l]`` of shape ``[size + 1, 1, 576]``
(slot 0 is the padding slot that padded tokens write to); a request's KV slot ids
are ``req_to_token[req_pool_idx, :seq_len]`` (int32), the free slots are the
allocator's ``free_pages`` (+ ``release_pages``) int64 tensors, and the radix
prefix cache keeps slot ids in each ``TreeNode.value`` (int64). A long-running
server scatters a request's slots over the pool; :func:`defrag` moves them to
contiguous runs.

Two steps, so that every check happens before anything is written:

1. :func:`plan_defrag` (pure: reads the inputs, writes nothing) validates the
   slot lists and picks, for every request that is not already one contiguous
   run, a destination run, and returns a :class:`DefragPlan` (``src -> dst``
   slot pairs and the free set afterwards). Bad input raises
   :class:`DefragInputError` (naming the argument); a pool without room for a
   run raises :class:`NotEnoughFreeSlotsError`.
2. :func:`apply_plan` gathers the moved rows of every layer into a temporary
   and scatters them to their destinations (safe when the source and
   destination sets overlap), then rewrites ``req_to_token`` and every other
   holder of slot ids through one lookup table. All temporaries are allocated
   before the first write.

Contract for use inside a server (between scheduler steps):

* No forward pass that reads the old slot ids may be in flight or prepared:
  no verify/extend/decode batch whose ``kv_indices``/``out_cache_loc`` were built
  from the old ``req_to_token`` (with SGLang's overlap scheduler, call it at a
  point where the next batch has not been prepared, or rebuild its metadata).
  CUDA-graph replays rebuild ``kv_indices`` from ``req_to_token`` each step, so
  they pick up the new ids.
* Everything runs on the caller's current stream (the stream the model runs
  on); any kernel enqueued after :func:`apply_plan` returns sees the whole move,
  so a request's KV is never read half-moved.
* Every holder of a moved slot id must be passed (``holders``): radix-tree node
  values (every live ``TreeNode.value`` of SGLang's radix cache), cached
  ``prefix_indices`` of live requests, and so on. Slot ids in use that appear
  in neither the requests, the holders nor the free set are left where they are
  and never used as a destination.
* Afterwards the allocator's free list must be replaced by
  :attr:`DefragResult.free_slots`.

Running it twice moves nothing the second time (requests already in one run are
skipped; the compacting strategy's target layout is a fixed point).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Strategy = Literal["runs", "compact", "auto"]
STRATEGIES: tuple[str, ...] = ("runs", "compact", "auto")
PADDING_SLOT = 0

BufferArg = torch.Tensor | Sequence[torch.Tensor]
IndexArg = torch.Tensor | Sequence[int]


class DefragError(ValueError):
    """Defrag refused its input; nothing was moved or changed."""


class DefragInputError(DefragError):
    """An argument is wrong; the message names it, what was expected and what came."""


class NotEnoughFreeSlotsError(DefragError):
    """No contiguous run of free slots is long enough for a request."""


def _err(arg: str, expected: str, got: object) -> DefragInputError:
    return DefragInputError(f"defrag: argument '{arg}': expected {expected}, got {got}")


# --------------------------------------------------------------------------- helpers


def count_runs(kv_indices: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """Number of maximal runs ``s, s+1, s+2, ...`` in each request's slot list.

    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` are request b's slot ids (the
    layout the verify kernel reads). Returns int64 ``[bs]`` on their device
    (0 for an empty request). Runs on the device without a host sync.
    """
    if kv_indptr.dim() != 1 or kv_indptr.numel() < 1:
        raise _err("kv_indptr", "a 1-D tensor of batch size + 1 >= 1 elements", list(kv_indptr.shape))
    if kv_indices.dim() != 1:
        raise _err("kv_indices", "a 1-D tensor", list(kv_indices.shape))
    bs = kv_indptr.numel() - 1
    dev = kv_indices.device
    indptr = kv_indptr.to(device=dev, dtype=torch.int64)
    lens = indptr[1:] - indptr[:-1]
    runs = (lens > 0).to(torch.int64)
    n = kv_indices.numel()
    if n > 1 and bs:
        idx = kv_indices.to(torch.int64)
        breaks = (idx[1:] - idx[:-1]) != 1  # between positions i and i + 1
        pos = torch.arange(n - 1, device=dev)
        owner = torch.searchsorted(indptr, pos, right=True) - 1  # the request holding position i
        ownc = owner.clamp(0, bs - 1)
        same = (owner >= 0) & (owner < bs) & (pos + 1 < indptr[ownc + 1])  # i + 1 in that request too
        runs = runs.scatter_add(0, ownc, (breaks & same).to(torch.int64))
    return runs


def contiguous_runs(kv_indices: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """Bool ``[bs]``: request b's slot ids form one contiguous ascending run
    (``kv_indices[kv_indptr[b]] + i`` for its i-th token; empty counts as one).

    The verify kernel may take a fast path (wider copies, one index load) for
    those requests. Computed on the device, no host sync (graph-capturable).
    """
    return count_runs(kv_indices, kv_indptr) <= 1


def _is_run(ids: torch.Tensor) -> bool:
    return ids.numel() <= 1 or bool(((ids[1:] - ids[:-1]) == 1).all())


def _free_runs(avail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the maximal runs of True in a bool vector."""
    pad = torch.zeros(1, dtype=torch.int8)
    d = torch.diff(torch.cat([pad, avail.to(torch.int8), pad]))
    starts = (d == 1).nonzero().flatten()
    ends = (d == -1).nonzero().flatten()
    return starts, ends - starts


class _RunSet:
    """The maximal runs of available slots, updated as runs are handed out
    (O(number of runs) per request instead of O(pool))."""

    def __init__(self, avail: torch.Tensor) -> None:
        self.starts, self.lens = _free_runs(avail)

    def longest(self) -> int:
        return int(self.lens.max()) if self.lens.numel() else 0

    def take(self, m: int, prefer: int | None) -> int | None:
        """Start of ``m`` available slots, now taken: at ``prefer`` if they are
        available there, else the front of the shortest run that fits (best
        fit; the lowest start on ties)."""
        if m == 0:
            return 0
        if prefer is not None and self.starts.numel():
            i = int(torch.searchsorted(self.starts, torch.tensor([prefer]), right=True)[0]) - 1
            if i >= 0:
                s, n = int(self.starts[i]), int(self.lens[i])
                if prefer + m <= s + n:
                    self._cut(i, s, prefer - s, prefer + m, s + n - prefer - m)
                    return prefer
        ok = self.lens >= m
        if not bool(ok.any()):
            return None
        i = int(torch.where(ok, self.lens, torch.iinfo(torch.int64).max).argmin())
        s, n = int(self.starts[i]), int(self.lens[i])
        self._cut(i, s, 0, s + m, n - m)
        return s

    def _cut(self, i: int, s0: int, n0: int, s1: int, n1: int) -> None:
        """Replace run i by the runs (s0, n0) and (s1, n1), dropping empty ones."""
        keep = [(a, b) for a, b in ((s0, n0), (s1, n1)) if b > 0]
        mid_s = torch.tensor([a for a, _ in keep], dtype=torch.int64)
        mid_n = torch.tensor([b for _, b in keep], dtype=torch.int64)
        self.starts = torch.cat([self.starts[:i], mid_s, self.starts[i + 1 :]])
        self.lens = torch.cat([self.lens[:i], mid_n, self.lens[i + 1 :]])


# --------------------------------------------------------------------------- inputs


def _as_index(name: str, x: IndexArg) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a tensor or a sequence of ints."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise _err(name, "a 1-D integer tensor", f"{x.dtype} of shape {list(x.shape)}")
        return x.detach().to(device="cpu", dtype=torch.int64)
    try:
        vals = [operator.index(v) for v in x]
    except TypeError:
        raise _err(name, "a 1-D integer tensor or a sequence of ints", type(x).__name__) from None
    return torch.tensor(vals, dtype=torch.int64)


def pool_layers(kv_buffers: BufferArg) -> list[torch.Tensor]:
    """The per-layer pools: a list of ``[P, ...]`` tensors, or one stacked
    ``[L, P, ...]`` tensor (its layers are views, so moves land in it)."""
    if isinstance(kv_buffers, torch.Tensor):
        if kv_buffers.dim() < 2:
            raise _err("kv_buffers", "a list of [P, ...] tensors or one stacked [L, P, ...] tensor",
                       f"a tensor of shape {list(kv_buffers.shape)}")
        layers = list(kv_buffers.unbind(0))
    else:
        layers = list(kv_buffers)
    if not layers:
        raise _err("kv_buffers", "at least one layer", "none")
    first = layers[0]
    for i, t in enumerate(layers):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise _err(f"kv_buffers[{i}]", "a tensor [P, ...]", type(t).__name__)
        if t.shape[0] != first.shape[0] or t.device != first.device:
            raise _err(f"kv_buffers[{i}]", f"{first.shape[0]} slots on {first.device} (as layer 0)",
                       f"{t.shape[0]} slots on {t.device}")
    return layers


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (x0, x1), (y0, y1) = span(a), span(b)
    return x0 < y1 and y0 < x1


def _check_holders(holders: Sequence[torch.Tensor], req_to_token: torch.Tensor) -> list[torch.Tensor]:
    out = list(holders)
    for i, h in enumerate(out):
        if not isinstance(h, torch.Tensor) or h.dim() != 1 or h.dtype.is_floating_point or h.dtype == torch.bool:
            got = f"{h.dtype} of shape {list(h.shape)}" if isinstance(h, torch.Tensor) else type(h).__name__
            raise _err(f"holders[{i}]", "a 1-D integer tensor of slot ids", got)
        if _aliases(h, req_to_token):
            raise _err(f"holders[{i}]", "a tensor that does not share memory with req_to_token",
                       "a view of req_to_token (it would be remapped twice)")
        for j in range(i):
            if _aliases(h, out[j]):
                raise _err(f"holders[{i}]", f"a tensor that does not share memory with holders[{j}]",
                           "an overlapping view (it would be remapped twice)")
    return out


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class DefragPlan:
    """What :func:`apply_plan` will do; all tensors are int64 on the CPU.

    ``src[i]`` moves to ``dst[i]``. ``free_after`` is the free set afterwards
    (sorted); ``freed`` the slots vacated, ``taken`` the previously free slots
    now holding KV. ``moved_requests`` are indices into ``rows``.
    """

    pool_size: int
    strategy: str
    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    src: torch.Tensor
    dst: torch.Tensor
    free_before: torch.Tensor
    free_after: torch.Tensor
    freed: torch.Tensor
    taken: torch.Tensor
    moved_requests: tuple[int, ...]

    @property
    def num_moves(self) -> int:
        return int(self.src.numel())


def _gather_rows(req_to_token: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor) -> list[torch.Tensor]:
    """Each request's slot ids as int64 CPU tensors (one device gather, one copy)."""
    if rows.numel() == 0:
        return []
    total = int(lens.sum())
    r = torch.repeat_interleave(rows, lens)
    starts = torch.cumsum(lens, 0) - lens
    c = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(starts, lens)
    flat = req_to_token[r.to(req_to_token.device), c.to(req_to_token.device)].to("cpu", torch.int64)
    return list(torch.split(flat, lens.tolist()))


def plan_defrag(
    pool_size: int,
    req_to_token: torch.Tensor,
    rows: IndexArg,
    lengths: IndexArg,
    free_slots: IndexArg,
    holders: Sequence[torch.Tensor] = (),
    *,
    strategy: Strategy = "runs",
    allow_shared: bool = False,
) -> DefragPlan:
    """Validate and plan a compaction; reads its inputs, changes nothing.

    pool_size: slots per layer pool, padding slot 0 included (SGLang: ``size + 1``).
    req_to_token: ``[R, max_context]`` integer tensor; request i's slots are
    ``req_to_token[rows[i], :lengths[i]]``. free_slots: the free set (SGLang:
    ``cat(free_pages, release_pages)``). holders: other 1-D tensors of slot ids
    that must follow the moves (radix node values).

    Strategies: ``"runs"`` moves each request that is not one contiguous run
    into a free run (best fit; the request's own slots and those of other
    moved requests count as free, as they are vacated) and raises
    :class:`NotEnoughFreeSlotsError` when none is long enough; ``"compact"``
    packs all live slots, request by request, into the lowest known slots
    (always fits; moves more); ``"auto"`` tries ``"runs"`` and falls back to
    ``"compact"``.

    Slots shared by several requests (prefix sharing) are an error unless
    ``allow_shared``; with it, ``"runs"`` leaves shared slots in place and
    moves each request's own slots into one run (after its shared prefix when
    there is room), and ``"compact"`` places a shared slot with its first
    request.
    """
    if strategy not in STRATEGIES:
        raise _err("strategy", " or ".join(repr(s) for s in STRATEGIES), repr(strategy))
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise _err("pool_size", "an int >= 1 (slots per layer, padding slot 0 included)", pool_size)
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype.is_floating_point:
        got = (f"{req_to_token.dtype} of shape {list(req_to_token.shape)}"
               if isinstance(req_to_token, torch.Tensor) else type(req_to_token).__name__)
        raise _err("req_to_token", "a 2-D integer tensor [rows, max_context]", got)
    rows_t, lens_t = _as_index("rows", rows), _as_index("lengths", lengths)
    if rows_t.numel() != lens_t.numel():
        raise _err("lengths", f"{rows_t.numel()} lengths (one per row)", lens_t.numel())
    R, ctx = req_to_token.shape
    if rows_t.numel():
        if int(rows_t.min()) < 0 or int(rows_t.max()) >= R:
            raise _err("rows", f"row indices in [0, {R})", f"range [{int(rows_t.min())}, {int(rows_t.max())}]")
        if torch.unique(rows_t).numel() != rows_t.numel():
            raise _err("rows", "distinct req_to_token rows", rows_t.tolist())
        if int(lens_t.min()) < 0 or int(lens_t.max()) > ctx:
            raise _err("lengths", f"lengths in [0, {ctx}] (req_to_token.shape[1])",
                       f"range [{int(lens_t.min())}, {int(lens_t.max())}]")
    free = _as_index("free_slots", free_slots)
    holder_list = _check_holders(holders, req_to_token)
    slots = _gather_rows(req_to_token, rows_t, lens_t)
    P = pool_size

    def check_range(name: str, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 1 or int(ids.max()) >= P):
            lo, hi = int(ids.min()), int(ids.max())
            what = "slot 0 (the padding slot)" if lo == PADDING_SLOT else f"range [{lo}, {hi}]"
            raise _err(name, f"slot ids in [1, {P}) (slot 0 is padding; the pool has {P} slots)", what)

    check_range("free_slots", free)
    if torch.unique(free).numel() != free.numel():
        raise _err("free_slots", "distinct slot ids", f"{free.numel() - torch.unique(free).numel()} duplicates")
    owners = torch.zeros(P, dtype=torch.int64)  # requests holding each slot
    for i, ids in enumerate(slots):
        check_range(f"req_to_token[rows[{i}]={int(rows_t[i])}]", ids)
        if torch.unique(ids).numel() != ids.numel():
            u, c = torch.unique(ids, return_counts=True)
            raise _err(f"req_to_token[rows[{i}]={int(rows_t[i])}]", "distinct slot ids within a request",
                       f"slot {int(u[c > 1][0])} {int(c.max())} times")
        owners[ids] += 1
    shared = owners > 1
    if bool(shared.any()) and not allow_shared:
        s = int(shared.nonzero()[0])
        who = [i for i, ids in enumerate(slots) if bool((ids == s).any())][:2]
        raise _err("req_to_token", "requests with disjoint slot ids (or allow_shared=True)",
                   f"slot {s} in requests {who[0]} and {who[1]} (rows {int(rows_t[who[0]])}, {int(rows_t[who[1]])})")
    is_free = torch.zeros(P, dtype=torch.bool)
    is_free[free] = True
    live_req = owners > 0
    if bool((live_req & is_free).any()):
        s = int((live_req & is_free).nonzero()[0])
        raise _err("free_slots", "no slot that a request holds", f"slot {s}")
    held = torch.zeros(P, dtype=torch.bool)
    for j, h in enumerate(holder_list):
        hc = h.detach().to("cpu", torch.int64)
        check_range(f"holders[{j}]", hc)
        if bool(is_free[hc].any()):
            raise _err(f"holders[{j}]", "slot ids that are not in free_slots",
                       f"slot {int(hc[is_free[hc]][0])}")
        held[hc] = True

    def runs_plan() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        # Slots that stay: shared ones, and those of requests already in one run.
        move = [not _is_run(ids[~shared[ids]]) for ids in slots]
        avail = is_free.clone()
        for i, ids in enumerate(slots):
            if move[i]:
                avail[ids[~shared[ids]]] = True
        order = sorted((i for i in range(len(slots)) if move[i]), key=lambda i: -int(slots[i].numel()))
        runs = _RunSet(avail)
        src, dst = [], []
        for i in order:
            ids = slots[i]
            own = ids[~shared[ids]]
            m = int(own.numel())
            before = ids[: int((~shared[ids]).nonzero()[0])] if m else ids
            prefer = int(before[-1]) + 1 if before.numel() else None
            start = runs.take(m, prefer)
            if start is None:
                raise NotEnoughFreeSlotsError(
                    f"defrag: not enough free slots for a contiguous run of {m} slots for request {i} "
                    f"(row {int(rows_t[i])}); the longest available run is {runs.longest()} slots "
                    "(free slots plus those vacated by moved requests); use strategy='compact' or 'auto'"
                )
            run = torch.arange(start, start + m, dtype=torch.int64)
            src.append(own)
            dst.append(run)
        return src, dst, order

    def compact_plan() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        seen = torch.zeros(P, dtype=torch.bool)
        order: list[torch.Tensor] = []
        for ids in slots:
            new = ids[~seen[ids]]
            seen[new] = True
            order.append(new)
        rest = (held & ~seen).nonzero().flatten()  # holder-only slots, ascending
        seq = torch.cat(order + [rest]) if (order or rest.numel()) else torch.empty(0, dtype=torch.int64)
        known = (is_free | live_req | held).nonzero().flatten()  # sorted
        target = known[: seq.numel()]
        return [seq], [target], list(range(len(slots)))

    used = strategy
    if strategy == "compact":
        src_l, dst_l, moved = compact_plan()
    else:
        try:
            src_l, dst_l, moved = runs_plan()
            used = "runs"
        except NotEnoughFreeSlotsError:
            if strategy == "runs":
                raise
            src_l, dst_l, moved = compact_plan()
            used = "compact"
    src = torch.cat(src_l) if src_l else torch.empty(0, dtype=torch.int64)
    dst = torch.cat(dst_l) if dst_l else torch.empty(0, dtype=torch.int64)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if used == "compact":
        moved = [i for i, ids in enumerate(slots) if bool(torch.isin(ids, src).any())]
    occupied_after = torch.zeros(P, dtype=torch.bool)
    was_live = live_req | held
    occupied_after[was_live] = True
    occupied_after[src] = False
    occupied_after[dst] = True
    freed = (was_live & ~occupied_after).nonzero().flatten()
    taken = (is_free & occupied_after).nonzero().flatten()
    free_after = ((is_free | was_live) & ~occupied_after).nonzero().flatten()
    return DefragPlan(
        pool_size=P, strategy=used, rows=tuple(rows_t.tolist()), lengths=tuple(lens_t.tolist()),
        src=src, dst=dst, free_before=torch.sort(free).values, free_after=free_after, freed=freed,
        taken=taken, moved_requests=tuple(sorted(moved)),
    )


# --------------------------------------------------------------------------- apply


@dataclass(frozen=True)
class DefragResult:
    """What a compaction did. ``free_slots`` (int64, on the device the free
    list came from) replaces the allocator's free list; ``freed`` are the slots
    vacated; ``bytes_moved`` is the KV payload moved over all layers (each
    byte is read twice and written twice through the temporary)."""

    plan: DefragPlan
    free_slots: torch.Tensor
    freed: torch.Tensor
    moved_slots: int
    bytes_moved: int
    layers: int


def apply_plan(
    plan: DefragPlan,
    kv_buffers: BufferArg,
    req_to_token: torch.Tensor,
    holders: Sequence[torch.Tensor] = (),
    *,
    free_device: torch.device | str | None = None,
) -> DefragResult:
    """Move the KV of every layer and rewrite ``req_to_token`` and ``holders``
    in place, on the current stream, as :func:`plan_defrag` planned.

    The plan must come from the same, unchanged state. Works on CPU and CUDA
    tensors. Every temporary is allocated before the first write.
    """
    layers = pool_layers(kv_buffers)
    if layers[0].shape[0] != plan.pool_size:
        raise _err("kv_buffers", f"{plan.pool_size} slots per layer (the planned pool size)", layers[0].shape[0])
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2:
        raise _err("req_to_token", "the 2-D tensor the plan was made from", type(req_to_token).__name__)
    holder_list = _check_holders(holders, req_to_token)
    dev = layers[0].device
    out_dev = torch.device(free_device) if free_device is not None else torch.device("cpu")
    n = plan.num_moves
    rows = torch.tensor(plan.rows, dtype=torch.int64)
    lens = torch.tensor(plan.lengths, dtype=torch.int64)
    row_bytes = sum(t[0].numel() * t.element_size() for t in layers)
    if n:
        # Allocate everything first: a failure here leaves the state untouched.
        src, dst = plan.src.to(dev), plan.dst.to(dev)
        tmps: dict[tuple, torch.Tensor] = {}
        for t in layers:
            key = (tuple(t.shape[1:]), t.dtype)
            if key not in tmps:
                tmps[key] = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=dev)
        lut = torch.arange(plan.pool_size, dtype=torch.int64, device=req_to_token.device)
        lut[plan.src.to(lut.device)] = plan.dst.to(lut.device)  # identity for slots that stay
        luts = {h.device: lut.to(h.device) for h in holder_list}
        r = torch.repeat_interleave(rows, lens)
        c = torch.arange(int(lens.sum()), dtype=torch.int64) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        cells = (r.to(req_to_token.device), c.to(req_to_token.device))
        new_ids = lut[req_to_token[cells].to(torch.int64)].to(req_to_token.dtype)
        new_holders = [luts[h.device][h.to(torch.int64)].to(h.dtype) for h in holder_list]
        for t in layers:
            tmp = tmps[(tuple(t.shape[1:]), t.dtype)]
            torch.index_select(t, 0, src, out=tmp)  # gather every source first,
            t.index_copy_(0, dst, tmp)  # then scatter: safe when sources and destinations overlap
        req_to_token[cells] = new_ids
        for h, v in zip(holder_list, new_holders, strict=True):
            h.copy_(v)
    return DefragResult(
        plan=plan, free_slots=plan.free_after.to(out_dev), freed=plan.freed.to(out_dev),
        moved_slots=n, bytes_moved=n * row_bytes, layers=len(layers),
    )


def defrag(
    kv_buffers: BufferArg,
    req_to_token: torch.Tensor,
    rows: IndexArg,
    lengths: IndexArg,
    free_slots: IndexArg,
    holders: Sequence[torch.Tensor] = (),
    *,
    strategy: Strategy = "runs",
    allow_shared: bool = False,
) -> DefragResult:
    """Plan and apply a compaction (see the module docstring for the contract).

    Returns a :class:`DefragResult`; its ``free_slots`` are on the device of
    ``free_slots`` (CPU for a Python sequence).
    """
    layers = pool_layers(kv_buffers)
    plan = plan_defrag(layers[0].shape[0], req_to_token, rows, lengths, free_slots, holders,
                       strategy=strategy, allow_shared=allow_shared)
    dev = free_slots.device if isinstance(free_slots, torch.Tensor) else None
    return apply_plan(plan, layers, req_to_token, holders, free_device=dev)
