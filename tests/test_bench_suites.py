"""Suite definitions, floor arithmetic and input sets (CPU)."""

from __future__ import annotations

import pytest
import torch

from kdtree_pipeline.bench import data, roofline, suites
from kdtree_pipeline.bench.peers import PEERS, PeerUnsupported, paged_chain_cache
from kdtree_pipeline.bench.suites import Case
from kdtree_pipeline.oracle import reference, workloads

# docs/design.md section 6, as printed there: (bs, T, H, ctx) and its floor in microseconds
DESIGN_ROWS = [
    (1, 16, 8, 4096, 1.4), (1, 16, 8, 23000, 8.1), (1, 16, 8, 65536, 23.1), (1, 16, 8, 91000, 32.1),
    (1, 16, 64, 32768, 92.5), (8, 16, 8, 32768, 92.5), (32, 8, 16, 8192, 92.5), (64, 4, 16, 4096, 70.7),
    (64, 4, 16, 16384, 283), (16, 8, 128, 8192, 370), (1, 4, 128, 65536, 92.4), (1, 64, 8, 65536, 92.5),
    (4, 32, 16, 32768, 185),
]


#: the micro suite's ragged cases, by name
MICRO_RAGGED = ["bs8-N16-H8-ragged-one64k-seven1k", "bs8-N16-H8-ragged-geometric32k",
                "bs4-N16-H8-ragged-one91k-three4k", "bs32-N8-H16-ragged-one32k-rest2k",
                "bs16-N16-H8-ragged-two64k-rest1k"]


def test_micro_is_the_design_table_the_nohint_and_the_ragged_cases():
    micro = suites.SUITES["micro"]
    hinted = [c for c in micro.cases if c.hint and not c.is_ragged]
    assert [(c.bs, c.n, c.heads, c.prefix) for c in hinted] == [r[:4] for r in DESIGN_ROWS]
    # issue 16: bs1 N16 H8 at 1k and 4k as under graph capture (ours without the host hint)
    assert [(c.bs, c.n, c.heads, c.prefix, c.name) for c in micro.cases if not c.hint] == [
        (1, 16, 8, 1024, "bs1-N16-H8-L1024-nohint"), (1, 16, 8, 4096, "bs1-N16-H8-L4096-nohint")]
    ragged = [c for c in micro.cases if c.is_ragged]
    assert [c.name for c in ragged] == MICRO_RAGGED and all(c.hint and c.layout == "fragmented" for c in ragged)
    assert len(micro.cases) == len(DESIGN_ROWS) + 2 + len(MICRO_RAGGED)
    assert all(c.masks == ("tree", "chain") for c in micro.cases)
    assert micro.systems == suites.SYSTEMS
    assert "extend_50x" not in micro.targets  # docs/design.md section 6: the 50x target is the long-context suite's


def test_micro_ragged_cases_are_the_mixed_batches_measured_against_flashmla():
    """The micro suite's ragged batches: one or two long requests among short ones, with
    these drafts, heads and per-request prefixes (the batches on which FlashMLA's per-SM cut
    of the work first beat ours, before the batch schedule)."""
    want = [
        ("bs8-N16-H8-ragged-one64k-seven1k", (65536,) + (1024,) * 7, 16, 8),
        ("bs8-N16-H8-ragged-geometric32k", tuple(32768 >> i for i in range(8)), 16, 8),
        ("bs4-N16-H8-ragged-one91k-three4k", (91000, 4096, 4096, 4096), 16, 8),
        ("bs32-N8-H16-ragged-one32k-rest2k", (32768,) + (2048,) * 31, 8, 16),
        ("bs16-N16-H8-ragged-two64k-rest1k", (65536, 65536) + (1024,) * 14, 16, 8),
    ]
    got = [(c.name, tuple(c.prefixes), c.n, c.heads) for c in suites.SUITES["micro"].cases if c.is_ragged]
    assert got == want
    for c in suites.SUITES["micro"].cases:
        if c.is_ragged:
            assert c.prefix == max(c.prefixes) and c.bs == len(c.prefixes) and len(set(c.prefixes)) > 1


def test_long_context_suite():
    lc = suites.SUITES["long-context"]
    assert {(c.bs, c.heads) for c in lc.cases} == {(1, 8)}
    assert sorted({c.n for c in lc.cases}) == [16, 64]
    assert sorted({c.prefix for c in lc.cases}) == [23000, 32768, 49152, 65536, 91000]
    assert len(lc.cases) == 10 and "extend_50x" in lc.targets and "floor_fraction" in lc.targets
    assert suites.FLOOR_SHAPE in {(c.bs, c.n, c.heads, c.prefix) for c in lc.cases}


def test_fragmentation_and_graph_suites():
    fr = suites.SUITES["fragmentation"]
    assert {c.layout for c in fr.cases} == {"contiguous", "runs16", "runs64", "runs256", "fragmented"}
    # the suite's report order and the data builder's list name the same layouts
    assert sorted(suites.FRAG_LAYOUTS) == sorted(workloads.LAYOUTS)
    assert min(c.prefix for c in fr.cases) == 4096 and max(c.prefix for c in fr.cases) == 91000
    assert fr.systems == ("ours", "ours-sm120", "sglang-extend")
    assert fr.targets == ("fragmentation", "sm120_fragmentation")
    assert len({c.name for c in fr.cases}) == len(fr.cases)
    gr = suites.SUITES["graph"]
    assert {(c.bs, c.prefix) for c in gr.cases} == {(1, 1024), (1, 65536), (32, 1024), (32, 65536)}
    assert gr.systems == ("ours",) and gr.targets == ()


def test_case_names_unique_and_checked():
    for s in suites.SUITES.values():
        assert len({c.name for c in s.cases}) == len(s.cases)
    with pytest.raises(ValueError, match="Case.masks"):
        Case(1, 4, 8, 10, masks=("square",))
    with pytest.raises(ValueError, match="Case.bs"):
        Case(0, 4, 8, 10)


ONE64K = (65536,) + (1024,) * 7


def test_ragged_case_names_series_and_lengths():
    c = Case.ragged(16, 8, ONE64K, "one64k-seven1k")
    assert (c.bs, c.prefix, c.prefixes, c.is_ragged) == (8, 65536, ONE64K, True)
    assert c.prefix_lens == ONE64K and c.total_prefix == 65536 + 7 * 1024
    assert c.name == "bs8-N16-H8-ragged-one64k-seven1k"
    assert c.series == "bs8 N16 H8 ragged one64k-seven1k"
    assert c == Case(8, 16, 8, 65536, prefixes=ONE64K, label="one64k-seven1k")  # what ragged() builds
    # no label: the name spells the lengths, longest first, as COUNTxLEN
    assert Case.ragged(4, 2, (10, 300, 10)).name == "bs3-N4-H2-ragged-1x300-2x10"
    # the layout and hint tags as for a uniform case, after the ragged part
    tagged = Case.ragged(16, 8, ONE64K, "one64k-seven1k", layout="runs16", hint=False)
    assert tagged.name == "bs8-N16-H8-ragged-one64k-seven1k-runs16-nohint"
    assert tagged.series == "bs8 N16 H8 ragged one64k-seven1k runs16 nohint"
    # a uniform case is unchanged, and no ragged case falls into its prefix series
    u = Case(8, 16, 8, 65536)
    assert (u.name, u.series, u.prefix_lens, u.is_ragged) == ("bs8-N16-H8-L65536", "bs8 N16 H8", (65536,) * 8, False)
    assert c.series != u.series and c.name != u.name
    assert u.ragged_label is None and c.shape == (8, 16, 8, ONE64K) and u.shape == (8, 16, 8, (65536,) * 8)


@pytest.mark.parametrize("kw,match", [
    (dict(bs=3, prefix=300, prefixes=(10, 300)),
     r"Case\.prefixes: expected 3 prefix lengths \(one per request, bs = 3\), got 2"),
    (dict(bs=2, prefix=300, prefixes=(-1, 300)), r"Case\.prefixes: expected lengths >= 0, got \(-1, 300\)"),
    (dict(bs=2, prefix=300, prefixes=(300, 300)), r"Case\.prefixes: expected lengths that differ.*got \(300, 300\)"),
    (dict(bs=2, prefix=10, prefixes=(10, 300)),
     r"Case\.prefix: expected the longest of Case\.prefixes \(300\) for a ragged case, got 10"),
    (dict(bs=2, prefix=300, prefixes=[10, 300]), r"Case\.prefixes: expected a tuple of ints.*got \[10, 300\]"),
    (dict(bs=2, prefix=300, prefixes=(10.0, 300)), r"Case\.prefixes: expected a tuple of ints"),
    (dict(bs=2, prefix=300, label="one300"), r"Case\.label: expected only with Case\.prefixes.*got 'one300'"),
    (dict(bs=2, prefix=300, prefixes=(10, 300), label="one 300"),
     r"Case\.label: expected letters, digits.*got 'one 300'"),
    (dict(bs=2, prefix=300, prefixes=(10, 300), label="a,b"), r"Case\.label: expected letters, digits.*got 'a,b'"),
])
def test_ragged_case_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        Case(n=4, heads=8, **kw)


def test_get_suite_and_systems_errors():
    with pytest.raises(ValueError, match=r"--suite: expected one of micro, long-context.*got 'nano'"):
        suites.get_suite("nano")
    micro = suites.SUITES["micro"]
    assert suites.parse_systems(None, micro) == suites.SYSTEMS
    assert suites.parse_systems("flashmla,ours", micro) == ("ours", "flashmla")  # table order
    with pytest.raises(ValueError, match="unknown system.*vllm"):
        suites.parse_systems("ours,vllm", micro)
    with pytest.raises(ValueError, match="--systems: expected a comma list"):
        suites.parse_systems(" , ", micro)


@pytest.mark.parametrize("row", DESIGN_ROWS, ids=lambda r: f"bs{r[0]}-N{r[1]}-H{r[2]}-L{r[3]}")
def test_floor_matches_design_table(row):
    bs, n, h, L, design_us = row
    ce = roofline.Ceilings(4.27e12, 790e12)
    got = roofline.floor_us(Case(bs, n, h, L), ce)
    # docs/design.md's memory-bound rows count the KV only; ours adds q, k_ext and out (a few percent)
    assert design_us * 0.99 <= got <= design_us * 1.05


def test_floor_terms_by_hand():
    c = Case(2, 4, 16, 1000)
    assert roofline.case_bytes(c) == 2 * 1000 * 1152 + 2 * 4 * 16 * 1152 + 2 * 4 * 1152 + 2 * 4 * 16 * 1024
    assert roofline.case_flops(c) == 2 * (2 * 64 * 1004 * 1088)
    slow_mem = roofline.Ceilings(1e9, 1e15)
    t = roofline.floor_terms(c, slow_mem)
    assert t["bound"] == "memory" and t["floor_us"] == pytest.approx(roofline.case_bytes(c) / 1e9 * 1e6)
    slow_mm = roofline.Ceilings(1e15, 1e9)
    assert roofline.floor_terms(c, slow_mm)["bound"] == "compute"
    with pytest.raises(ValueError, match="ceilings must be positive"):
        roofline.floor_us(c, roofline.Ceilings(0.0, 1.0))


def test_ragged_floor_is_the_sum_of_its_requests():
    """Bytes and flops add up over the requests at their own lengths, so under ceilings that
    bind every request on the same term the floor is the sum of the requests' floors; it is
    not the floor of bs requests at the longest prefix."""
    c = Case.ragged(16, 8, ONE64K, "one64k-seven1k")
    alone = [Case(1, 16, 8, L) for L in ONE64K]
    assert roofline.case_bytes(c) == sum(roofline.case_bytes(a) for a in alone)
    assert roofline.case_flops(c) == sum(roofline.case_flops(a) for a in alone)
    assert roofline.case_bytes(c) == (65536 + 7 * 1024) * 1152 + 8 * 16 * (8 * 1152 + 1152 + 8 * 1024)
    for ce in (roofline.Ceilings(4.27e12, 790e12), roofline.Ceilings(1e9, 1e15), roofline.Ceilings(1e15, 1e9)):
        bound = {roofline.floor_terms(a, ce)["bound"] for a in alone}
        assert len(bound) == 1 and roofline.floor_terms(c, ce)["bound"] in bound
        assert roofline.floor_us(c, ce) == pytest.approx(sum(roofline.floor_us(a, ce) for a in alone))
    ce = roofline.Ceilings(4.27e12, 790e12)
    assert roofline.floor_us(c, ce) < 0.2 * roofline.floor_us(Case(8, 16, 8, 65536), ce)
    # the rotations follow the batch's real bytes, not bs x the longest prefix
    l2 = 60 * 2**20
    r = data.rotations(c, l2)
    assert r * roofline.case_bytes(c) >= 3 * l2 > (r - 1) * roofline.case_bytes(c)


def _request(b: workloads.Batch, r: int) -> workloads.Batch:
    """Request ``r`` of batch ``b`` as a batch of its own (its rows, slots and mask)."""
    qo, kv, mi = (x.tolist() for x in (b.qo_indptr, b.kv_indptr, b.mask_indptr))

    def ptr(x: list[int], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor([0, x[r + 1] - x[r]], dtype=like.dtype)

    return workloads.Batch(
        q=b.q[qo[r]: qo[r + 1]], k_ext=b.k_ext[qo[r]: qo[r + 1]], kv_buffer=b.kv_buffer,
        qo_indptr=ptr(qo, b.qo_indptr), kv_indptr=ptr(kv, b.kv_indptr), kv_indices=b.kv_indices[kv[r]: kv[r + 1]],
        custom_mask=b.custom_mask[mi[r]: mi[r + 1]], mask_indptr=ptr(mi, b.mask_indptr), sm_scale=b.sm_scale,
        max_n=b.max_n, prefix_lens=[b.prefix_lens[r]], n_drafts=[b.n_drafts[r]], parents=[b.parents[r]])


def test_ragged_build_sets_give_each_request_its_own_length():
    lens = (70, 0, 33)
    c = Case.ragged(4, 2, lens, "mix", layout="runs16")
    sets = data.build_sets(c, 2, "cpu", seed=3)
    for m in ("tree", "chain"):
        b = sets[0].batch(m)
        assert b.prefix_lens == list(lens) and b.n_drafts == [4, 4, 4] and b.bs == 3
        assert b.kv_indptr.tolist() == [0, 70, 70, 103] and b.qo_indptr.tolist() == [0, 4, 8, 12]
        assert b.mask_indptr.tolist() == [0, 4 * 74, 4 * 74 + 4 * 4, 4 * 74 + 4 * 4 + 4 * 37]
        assert b.kv_indices.numel() == 103 and b.kv_indices.unique().numel() == 103 and int(b.kv_indices.min()) >= 1
        ref = reference.verify_attention_ref(*b.ref_args())[0]
        for r, L in enumerate(lens):
            mk = b.custom_mask[b.mask_indptr[r]: b.mask_indptr[r + 1]].view(4, L + 4)
            assert torch.equal(mk, workloads.full_mask(b.parents[r], L))
            # request r computed alone, on its own slots and mask, is its rows of the batch
            alone = reference.verify_attention_ref(*_request(b, r).ref_args())[0]
            assert torch.equal(ref[4 * r: 4 * r + 4], alone)
    assert not torch.equal(sets[0].batch("tree").q, sets[1].batch("tree").q)


def test_ragged_batches_reach_the_peers_with_their_lengths(monkeypatch):
    """Ours gets the longest prefix as its host hint; FlashMLA's paged cache holds each request's
    own prefix and drafts with cache_seqlens = prefix + N; SGLang's kernels take the batch's
    indptrs (checked above) as they are."""
    from kdtree_engine.kernel import op

    lens = (70, 5, 33)
    chain = data.build_sets(Case.ragged(4, 2, lens, "mix"), 1, "cpu")[0].batch("chain")
    calls = []
    monkeypatch.setattr(op, "verify_attention", lambda *a, **kw: calls.append(kw["max_prefix_len"]) or kw["out"])
    PEERS["ours"].prepare(chain)()
    PEERS["ours"].prepare(data.build_sets(Case.ragged(4, 2, lens, "mix", hint=False), 1, "cpu")[0].batch("chain"))()
    assert calls == [70, None]
    k_cache, table, seqlens = paged_chain_cache(chain, page=16)
    assert seqlens.tolist() == [74, 9, 37]
    flat, start = k_cache.view(-1, 576), 0
    for r, L in enumerate(lens):
        rows = torch.cat([flat[int(blk) * 16: int(blk) * 16 + 16] for blk in table[r, : -(-(L + 4) // 16)]])[: L + 4]
        want = torch.cat([chain.kv_buffer[chain.kv_indices[start: start + L], 0], chain.k_ext[4 * r: 4 * r + 4, 0]])
        assert torch.equal(rows, want)
        start += L
    split = PEERS["sglang-splitkv"]
    if split.check() is None:  # split-KV's can_handle takes ragged prefixes (its drafts per request are equal)
        assert callable(split.prepare(chain))


def test_rotations():
    l2 = 60 * 2**20
    tiny, big = Case(1, 16, 8, 64), Case(64, 4, 16, 16384)
    assert data.rotations(big, l2) == 1
    assert data.rotations(tiny, l2) == data.MAX_ROTATIONS
    for mid in (Case(1, 16, 8, 4096), Case(1, 16, 8, 65536)):
        r = data.rotations(mid, l2)
        assert r * roofline.case_bytes(mid) >= 3 * l2 > (r - 1) * roofline.case_bytes(mid)


def test_nohint_case_is_ours_without_the_hint_on_the_same_data(monkeypatch):
    """A ``hint=False`` case builds the same request as its hinted twin (same seed) and
    marks its batches so that ours is called without ``max_prefix_len``."""
    from kdtree_engine.kernel import op

    with_hint, without = Case(1, 4, 2, 70), Case(1, 4, 2, 70, hint=False)
    assert without.name == "bs1-N4-H2-L70-nohint" and without.series == "bs1 N4 H2 nohint"
    b0 = data.build_sets(with_hint, 1, "cpu", seed=2)[0].batch("tree")
    b1 = data.build_sets(without, 1, "cpu", seed=2)[0].batch("tree")
    assert torch.equal(b0.q, b1.q) and torch.equal(b0.kv_buffer, b1.kv_buffer)
    assert b0.meta["hint"] is True and b1.meta["hint"] is False
    calls = []

    def fake(*args, **kw):
        calls.append(kw.get("max_prefix_len"))
        return kw["out"]

    monkeypatch.setattr(op, "verify_attention", fake)
    PEERS["ours"].prepare(b0)()
    PEERS["ours-sm120"].prepare(b1)()
    assert calls == [70, None]


def test_build_sets_layout_masks_and_data():
    c = Case(2, 5, 3, 100, layout="runs16")
    sets = data.build_sets(c, 2, "cpu", seed=3)
    tree, chain = sets[0].batch("tree"), sets[0].batch("chain")
    assert tree.q is chain.q and tree.kv_buffer is chain.kv_buffer
    assert tree.kv_indptr.tolist() == [0, 100, 200] and tree.qo_indptr.tolist() == [0, 5, 10]
    for b in range(2):
        L, n = 100, 5
        m = chain.custom_mask[chain.mask_indptr[b]: chain.mask_indptr[b + 1]].view(n, L + n)
        assert torch.equal(m, workloads.full_mask(workloads.chain(n), L))
        mt = tree.custom_mask[tree.mask_indptr[b]: tree.mask_indptr[b + 1]].view(n, L + n)
        assert torch.equal(mt, workloads.full_mask(tree.parents[b], L))
    ids = tree.kv_indices
    assert ids.unique().numel() == ids.numel() and int(ids.min()) >= 1
    assert int(ids.max()) < tree.kv_buffer.shape[0]
    # random, never zeros; the sets hold different data
    assert tree.q.float().std() > 0.5 and not torch.equal(sets[0].batch("tree").q, sets[1].batch("tree").q)
    with pytest.raises(KeyError, match="mask 'square' not built"):
        sets[0].batch("square")


def test_same_request_whatever_the_layout():
    outs = []
    for lay in ("contiguous", "runs16", "fragmented"):
        b = data.build_sets(Case(2, 4, 2, 70, layout=lay, masks=("tree",)), 1, "cpu", seed=5)[0].batch("tree")
        outs.append(reference.verify_attention_ref(*b.ref_args())[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_paged_chain_cache_holds_prefix_then_drafts():
    b = data.build_sets(Case(3, 5, 2, 70), 1, "cpu")[0].batch("chain")
    k_cache, table, lens = paged_chain_cache(b, page=16)
    assert lens.tolist() == [75, 75, 75] and k_cache.shape[1:] == (16, 1, 576)
    flat = k_cache.view(-1, 576)
    for r in range(3):
        rows = torch.cat([flat[int(blk) * 16: int(blk) * 16 + 16] for blk in table[r, : -(-75 // 16)]])[:75]
        want = torch.cat([b.kv_buffer[b.kv_indices[70 * r: 70 * (r + 1)], 0], b.k_ext[5 * r: 5 * (r + 1), 0]])
        assert torch.equal(rows, want)


def test_peer_masks_and_splitkv_adapter_arguments():
    assert PEERS["ours"].masks(("tree", "chain")) == ("tree", "chain")
    assert PEERS["flashmla"].masks(("tree", "chain")) == ("chain",)
    assert PEERS["sglang-splitkv"].masks(("tree",)) == ()
    assert PEERS["sglang-extend"].masks(("tree", "chain")) == ("tree",)
    split = PEERS["sglang-splitkv"]
    if split.check() is not None:
        pytest.skip(f"sglang verify_mla not importable: {split.check()}")
    b = data.build_sets(Case(2, 4, 8, 64), 1, "cpu")[0].batch("chain")
    assert callable(split.prepare(b))  # can_handle accepts SGLang's own topk=1 verify layout
    ragged = workloads.Batch(**{**b.__dict__, "max_n": 5})  # rows != bs * max_len_extend
    with pytest.raises(PeerUnsupported, match="can_handle"):
        split.prepare(ragged)
