"""KV defrag on CPU tensors: planning, moving, bad input, idempotence, holders."""

from __future__ import annotations

import random

import pytest
import torch

from kdtree_engine.defrag import (
    DefragError,
    DefragInputError,
    NotEnoughFreeSlotsError,
    apply_plan,
    contiguous_runs,
    count_runs,
    defrag,
    plan_defrag,
)
from kdtree_pipeline.defrag import compaction_trial, random_pool

D = 8  # latent width in these tests (the code is width-agnostic; the gate uses 576)


def make_state(seed: int, pool_tokens: int = 300, lens=(40, 25, 60, 7), layers: int = 3, holder_only: int = 5):
    """Scattered requests, a free list, radix-like holders (prefix copies) and holder-only slots."""
    g = torch.Generator().manual_seed(seed)
    P = pool_tokens + 1
    kv = [torch.randn((P, 1, D), generator=g).to(torch.bfloat16) for _ in range(layers)]
    perm = torch.randperm(pool_tokens, generator=g) + 1
    r2t = torch.zeros((len(lens) + 2, max(lens) + 3), dtype=torch.int32)
    rows = list(range(2, 2 + len(lens)))
    off = 0
    for row, n in zip(rows, lens, strict=True):
        r2t[row, :n] = perm[off : off + n].to(torch.int32)
        off += n
    only = perm[off : off + holder_only].clone()
    free = perm[off + holder_only :].clone()
    holders = [r2t[rows[0], : lens[0] // 2].to(torch.int64), only.clone()]
    return kv, r2t, rows, list(lens), free, holders, only


def request_kv(kv, r2t, rows, lens):
    return [[t[r2t[r, :n].long()].clone() for t in kv] for r, n in zip(rows, lens, strict=True)]


def snapshot(kv, r2t, free, holders):
    return [t.clone() for t in kv], r2t.clone(), free.clone(), [h.clone() for h in holders]


def assert_unchanged(snap, kv, r2t, free, holders):
    kv0, r2t0, free0, h0 = snap
    assert all(torch.equal(a, b) for a, b in zip(kv0, kv, strict=True))
    assert torch.equal(r2t0, r2t)
    assert torch.equal(free0, free)
    assert all(torch.equal(a, b) for a, b in zip(h0, holders, strict=True))


def indptr(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("strategy", ["runs", "compact", "auto"])
def test_defrag_makes_runs_and_keeps_every_token(strategy):
    kv, r2t, rows, lens, free, holders, only = make_state(0)
    before = request_kv(kv, r2t, rows, lens)
    only_kv = [t[only].clone() for t in kv]
    live_free_before = torch.unique(torch.cat([r2t[r, :n].long() for r, n in zip(rows, lens, strict=True)] + [only, free]))
    res = defrag(kv, r2t, rows, lens, free, holders, strategy=strategy)
    assert res.moved_slots > 0 and res.bytes_moved == res.moved_slots * 3 * D * 2
    for x, y in zip(request_kv(kv, r2t, rows, lens), before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
    # holder-only slots: their KV follows the (remapped) holder; only "compact" moves them
    assert all(torch.equal(t[holders[1]], s) for t, s in zip(kv, only_kv, strict=True))
    assert torch.equal(holders[1], only) == (res.plan.strategy == "runs")
    new = [r2t[r, :n].long() for r, n in zip(rows, lens, strict=True)]
    assert bool(contiguous_runs(torch.cat(new), indptr(lens)).all())
    assert torch.equal(holders[0], new[0][: lens[0] // 2])  # the prefix copy follows request 0
    # free list: same size, disjoint from live slots, live + free cover the same slots
    live = torch.cat(new + [holders[1]])
    assert res.free_slots.numel() == free.numel()
    assert not bool(torch.isin(res.free_slots, live).any())
    assert torch.equal(torch.unique(torch.cat([live, res.free_slots])), live_free_before)
    assert torch.equal(torch.sort(res.free_slots).values, res.free_slots)
    # freed = vacated slots: were live, now free
    assert bool(torch.isin(res.freed, res.free_slots).all())


@pytest.mark.parametrize("strategy", ["runs", "compact", "auto"])
def test_second_run_moves_nothing(strategy):
    kv, r2t, rows, lens, free, holders, _ = make_state(1)
    first = defrag(kv, r2t, rows, lens, free, holders, strategy=strategy)
    snap = snapshot(kv, r2t, first.free_slots, holders)
    second = defrag(kv, r2t, rows, lens, first.free_slots, holders, strategy=strategy)
    assert first.moved_slots > 0
    assert second.moved_slots == 0 and second.bytes_moved == 0
    assert torch.equal(second.free_slots, first.free_slots)
    assert_unchanged(snap, kv, r2t, first.free_slots, holders)


def test_already_contiguous_request_is_not_moved():
    kv, r2t, rows, lens, free, holders, _ = make_state(2)
    res = defrag(kv, r2t, rows, lens, free, holders)
    r2t[rows[0], : lens[0]] = r2t[rows[0], : lens[0]].flip(0)  # request 0 is no run any more
    others = torch.cat([r2t[r, :n].long() for r, n in zip(rows[1:], lens[1:], strict=True)])
    plan = plan_defrag(kv[0].shape[0], r2t, rows, lens, res.free_slots, holders)
    assert plan.moved_requests == (0,)
    assert not bool(torch.isin(plan.src, others).any())
    assert not bool(torch.isin(plan.dst, others).any())


def test_full_pool_moves_through_overlapping_slots():
    """No free slot at all: runs come from the requests' own vacated slots, so
    sources and destinations overlap; the copy must go through a temporary."""
    P = 41
    kv = [torch.arange(P * D, dtype=torch.float32).reshape(P, 1, D)]
    ids = list(range(1, P))
    a, b = ids[0::2], ids[1::2]  # interleaved: both requests fragmented
    r2t = torch.tensor([[0] * 20, a, b], dtype=torch.int32)
    before = request_kv(kv, r2t, [1, 2], [20, 20])
    plan = plan_defrag(P, r2t, [1, 2], [20, 20], torch.empty(0, dtype=torch.int64))
    assert bool(torch.isin(plan.dst, plan.src).any())  # overlapping sets indeed
    res = apply_plan(plan, kv, r2t)
    assert res.free_slots.numel() == 0
    after = request_kv(kv, r2t, [1, 2], [20, 20])
    for x, y in zip(after, before, strict=True):
        assert torch.equal(x[0], y[0])
    assert bool(contiguous_runs(torch.cat([r2t[1], r2t[2]]).long(), indptr([20, 20])).all())


def test_stacked_pool_is_moved_in_place():
    kv, r2t, rows, lens, free, holders, _ = make_state(3)
    stacked = torch.stack(kv)
    before = request_kv(list(stacked.unbind(0)), r2t, rows, lens)
    res = defrag(stacked, r2t, rows, lens, free, holders)
    assert res.layers == 3 and res.moved_slots > 0
    for x, y in zip(request_kv(list(stacked.unbind(0)), r2t, rows, lens), before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))


def test_not_enough_free_run_raises_and_auto_compacts():
    # Every other slot is pinned by a holder: no free run longer than 1.
    P = 101
    pinned = torch.arange(2, P, 2)
    r2t = torch.zeros((2, 10), dtype=torch.int32)
    r2t[1] = torch.tensor([3, 9, 15, 21, 27, 33, 39, 45, 51, 57], dtype=torch.int32)
    free = torch.tensor([x for x in range(1, P, 2) if x not in r2t[1].tolist()])
    kv = [torch.randn(P, 1, D)]
    holders = [pinned.clone()]
    snap = snapshot(kv, r2t, free, holders)
    with pytest.raises(NotEnoughFreeSlotsError, match="contiguous run of 10 slots"):
        defrag(kv, r2t, [1], [10], free, holders, strategy="runs")
    assert_unchanged(snap, kv, r2t, free, holders)
    before = request_kv(kv, r2t, [1], [10])
    pinned_kv = kv[0][pinned].clone()
    res = defrag(kv, r2t, [1], [10], free, holders, strategy="auto")
    assert res.plan.strategy == "compact"
    assert torch.equal(request_kv(kv, r2t, [1], [10])[0][0], before[0][0])
    assert bool(contiguous_runs(r2t[1].long(), torch.tensor([0, 10])).all())
    # compaction packs holder-only slots too: the holder is remapped and its KV follows
    assert torch.equal(kv[0][holders[0]], pinned_kv)
    assert torch.unique(torch.cat([holders[0], r2t[1].long(), res.free_slots])).numel() == P - 1


def _bad_cases():
    """(name, mutate(state) -> kwargs overrides, expected error, message fragment)."""

    def dup_in_request(s):
        s["r2t"][s["rows"][0], 1] = s["r2t"][s["rows"][0], 0]

    def overlap_requests(s):
        s["r2t"][s["rows"][1], 0] = s["r2t"][s["rows"][0], 0]

    def outside_pool(s):
        s["r2t"][s["rows"][2], 3] = 10_000

    def padding_slot(s):
        s["r2t"][s["rows"][2], 3] = 0

    def free_has_live(s):
        s["free"][0] = s["r2t"][s["rows"][0], 0]

    def free_has_padding(s):
        s["free"][0] = 0

    def free_dup(s):
        s["free"][1] = s["free"][0]

    def holder_in_free(s):
        s["holders"][1][0] = s["free"][0]

    def holder_outside(s):
        s["holders"][1][0] = -3

    def row_outside(s):
        s["rows"] = [*s["rows"][:-1], 99]

    def rows_dup(s):
        s["rows"] = [s["rows"][0], *s["rows"][:-1]]

    def length_too_long(s):
        s["lens"] = [*s["lens"][:-1], 10_000]

    def lengths_count(s):
        s["lens"] = s["lens"][:-1]

    def float_free(s):
        s["free_arg"] = s["free"].float()

    def bad_strategy(s):
        s["strategy"] = "fastest"

    def holder_view_of_r2t(s):
        s["holders_arg"] = [*s["holders"], s["r2t"][s["rows"][0], :3]]

    def holders_alias(s):
        s["holders_arg"] = [s["holders"][1], s["holders"][1][1:]]

    def no_room(s):
        s["free_arg"] = s["free"][:0]
        s["holders_arg"] = [*s["holders"], s["free"].clone()]  # pin every free slot

    return [
        ("duplicate slot in a request", dup_in_request, DefragInputError, "distinct slot ids within a request"),
        ("requests overlap", overlap_requests, DefragInputError, "disjoint slot ids"),
        ("slot outside the pool", outside_pool, DefragInputError, "slot ids in \\[1, 301\\)"),
        ("padding slot in a request", padding_slot, DefragInputError, "slot 0"),
        ("free list holds a live slot", free_has_live, DefragInputError, "'free_slots'"),
        ("free list holds slot 0", free_has_padding, DefragInputError, "'free_slots'.*slot 0"),
        ("free list duplicates", free_dup, DefragInputError, "distinct slot ids"),
        ("holder points at a free slot", holder_in_free, DefragInputError, "'holders\\[1\\]'"),
        ("holder outside the pool", holder_outside, DefragInputError, "'holders\\[1\\]'"),
        ("row outside req_to_token", row_outside, DefragInputError, "'rows'"),
        ("duplicate rows", rows_dup, DefragInputError, "distinct req_to_token rows"),
        ("length past max context", length_too_long, DefragInputError, "'lengths'"),
        ("one length missing", lengths_count, DefragInputError, "'lengths'"),
        ("float free list", float_free, DefragInputError, "'free_slots'"),
        ("unknown strategy", bad_strategy, DefragInputError, "'strategy'"),
        ("holder is a view of req_to_token", holder_view_of_r2t, DefragInputError, "remapped twice"),
        ("holders alias each other", holders_alias, DefragInputError, "remapped twice"),
        ("no room for a run", no_room, NotEnoughFreeSlotsError, "not enough free slots"),
    ]


@pytest.mark.parametrize("name,mutate,error,match", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_before_anything_changes(name, mutate, error, match):
    kv, r2t, rows, lens, free, holders, _ = make_state(4)
    s = {"r2t": r2t, "rows": rows, "lens": lens, "free": free, "holders": holders}
    mutate(s)
    snap = snapshot(kv, r2t, free, holders)
    with pytest.raises(error, match=match) as info:
        defrag(kv, r2t, s["rows"], s["lens"], s.get("free_arg", free), s.get("holders_arg", holders),
               strategy=s.get("strategy", "runs"))
    assert isinstance(info.value, DefragError) and isinstance(info.value, ValueError)
    assert_unchanged(snap, kv, r2t, free, holders)


def test_bad_buffers_are_refused():
    kv, r2t, rows, lens, free, holders, _ = make_state(5)
    with pytest.raises(DefragInputError, match="'kv_buffers\\[1\\]'"):
        defrag([kv[0], kv[1][:-1]], r2t, rows, lens, free, holders)
    with pytest.raises(DefragInputError, match="'kv_buffers'"):
        defrag([], r2t, rows, lens, free, holders)
    plan = plan_defrag(kv[0].shape[0], r2t, rows, lens, free, holders)
    snap = snapshot(kv, r2t, free, holders)
    with pytest.raises(DefragInputError, match="planned pool size"):
        apply_plan(plan, [t[:-1] for t in kv], r2t, holders)
    assert_unchanged(snap, kv, r2t, free, holders)


def test_shared_prefix_needs_allow_shared_and_keeps_it_in_place():
    kv, r2t, rows, lens, free, holders, _ = make_state(6, pool_tokens=3000, holder_only=0)
    shared = r2t[rows[0], :5].clone()
    r2t[rows[1], :5] = shared
    r2t[rows[2], :5] = shared
    with pytest.raises(DefragInputError, match="allow_shared"):
        defrag(kv, r2t, rows, lens, free, holders)
    before = request_kv(kv, r2t, rows, lens)
    res = defrag(kv, r2t, rows, lens, free, holders, allow_shared=True)
    assert res.moved_slots > 0
    for x, y in zip(request_kv(kv, r2t, rows, lens), before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
    for r in rows[:3]:
        assert torch.equal(r2t[r, :5], shared)  # shared prefix slots stay
    runs = count_runs(torch.cat([r2t[r, :n].long() for r, n in zip(rows, lens, strict=True)]), indptr(lens))
    assert int(runs.max()) <= 6  # <= 5 shared prefix runs + one run of the request's own slots
    again = defrag(kv, r2t, rows, lens, res.free_slots, holders, allow_shared=True)
    assert again.moved_slots == 0


@pytest.mark.parametrize("seed", range(12))
def test_random_pools_property(seed):
    """Random sizes, strategies and sharing: the gate's own checks hold on CPU."""
    rnd = random.Random(seed)
    strategy = rnd.choice(["runs", "compact", "auto"])
    shared = rnd.choice([0, 0, 8])
    pool = random_pool(seed, "cpu", rnd.randint(500, 4000), rnd.randint(1, 4), rnd.randint(1, 24),
                       fill=rnd.uniform(0.2, 0.9), shared_prefix=shared, head_dim=D)
    if strategy == "runs":  # may find no run long enough: then it must have changed nothing
        snap = snapshot(pool.layers, pool.req_to_token, pool.free, pool.holders)
        try:
            plan_defrag(pool.layers[0].shape[0], pool.req_to_token, pool.rows, pool.lengths, pool.free,
                        pool.holders, allow_shared=bool(shared))
        except NotEnoughFreeSlotsError:
            assert_unchanged(snap, pool.layers, pool.req_to_token, pool.free, pool.holders)
            strategy = "compact"
    figures = compaction_trial(pool, strategy, allow_shared=bool(shared))
    assert figures["tokens"] == sum(pool.lengths)
    if not shared:
        assert figures["runs_after_max"] <= 1


def _runs_ref(idx: list[int], ptr: list[int]) -> list[int]:
    out = []
    for b in range(len(ptr) - 1):
        seg = idx[ptr[b] : ptr[b + 1]]
        out.append(0 if not seg else 1 + sum(1 for x, y in zip(seg, seg[1:], strict=False) if y != x + 1))
    return out


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_count_runs_matches_a_plain_loop(dtype):
    rnd = random.Random(7)
    for _ in range(30):
        lens = [rnd.choice([0, 1, 2, rnd.randint(3, 40)]) for _ in range(rnd.randint(1, 8))]
        idx = []
        for n in lens:
            start = rnd.randint(1, 500)
            seg = list(range(start, start + n))
            for _ in range(rnd.randint(0, 3)):  # break some runs
                if n:
                    seg[rnd.randrange(n)] = rnd.randint(1, 1000)
            idx += seg
        ptr = [0]
        for n in lens:
            ptr.append(ptr[-1] + n)
        got = count_runs(torch.tensor(idx, dtype=dtype), torch.tensor(ptr, dtype=torch.int32))
        assert got.tolist() == _runs_ref(idx, ptr)
        assert contiguous_runs(torch.tensor(idx, dtype=dtype), torch.tensor(ptr)).tolist() == [
            r <= 1 for r in _runs_ref(idx, ptr)
        ]


def test_count_runs_edges():
    assert count_runs(torch.tensor([], dtype=torch.int64), torch.tensor([0])).tolist() == []
    assert count_runs(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 4])).tolist() == [1, 1]
    assert count_runs(torch.tensor([7, 6]), torch.tensor([0, 2])).tolist() == [2]  # descending is not a run
    with pytest.raises(DefragInputError, match="'kv_indptr'"):
        count_runs(torch.tensor([1]), torch.tensor([[0, 1]]))
