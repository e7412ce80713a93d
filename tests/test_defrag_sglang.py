"""The SGLang adapters of the defrag: radix-tree values, allocator free list.

``FakeTreeNode``/``FakeRadixCache`` copy the shape of SGLang 0.5.23's
``TreeNode`` (``children`` dict, ``parent``, ``key``, ``value``: int64 slot ids,
``None`` once evicted, ``[]`` at the root) and ``RadixCache`` (``root_node``,
``page_size``). The real ``RadixCache`` is used as well where sglang imports
(its import chain needs sglang's runtime dependencies, e.g. torchvision).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.defrag import DefragInputError
from kdtree_engine.defrag.sglang_adapter import (
    allocator_free_slots,
    defrag_sglang,
    radix_values,
    set_allocator_free_slots,
)

D = 8


class FakeTreeNode:
    def __init__(self, value=None, parent=None):
        self.children: dict = {}
        self.parent = parent
        self.key = None
        self.value = value


class FakeRadixCache:
    """Tree: root -> a [shared prefix] -> (b [rest of request 1], c [evicted]); root -> d [cached only]."""

    def __init__(self, prefix, rest, cached_only):
        self.page_size = 1
        self.root_node = FakeTreeNode(value=[])
        a = FakeTreeNode(prefix.clone(), self.root_node)
        b = FakeTreeNode(rest.clone(), a)
        c = FakeTreeNode(None, a)
        d = FakeTreeNode(cached_only.clone(), self.root_node)
        self.root_node.children = {1: a, 9: d}
        a.children = {2: b, 3: c}
        self.nodes = (a, b, c, d)


def sglang_state(seed=0, P=400):
    """Objects with the attributes SGLang's MLA pool, req_to_token pool and allocator have."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(P - 1, generator=g) + 1
    kv_pool = SimpleNamespace(kv_buffer=[torch.randn((P, 1, D), generator=g) for _ in range(2)],
                              size=P - 1, page_size=1)
    r2t = torch.zeros((4, 128), dtype=torch.int32)
    r2t[1, :100] = perm[:100].to(torch.int32)
    r2t[2, :60] = perm[100:160].to(torch.int32)
    cached_only = perm[160:170]
    free = perm[170:]
    allocator = SimpleNamespace(free_pages=free[:150].clone(), release_pages=free[150:].clone(), free_group=None)
    return kv_pool, SimpleNamespace(req_to_token=r2t), allocator, cached_only


def test_radix_values_walks_every_live_node():
    prefix, rest, only = torch.arange(1, 5), torch.arange(10, 13), torch.arange(20, 22)
    cache = FakeRadixCache(prefix, rest, only)
    vals = radix_values(cache)
    a, b, c, d = cache.nodes
    assert [v.tolist() for v in vals] == [prefix.tolist(), rest.tolist(), only.tolist()]
    assert vals[0] is a.value and vals[1] is b.value and vals[2] is d.value  # the tree's own tensors
    cache.page_size = 64
    with pytest.raises(DefragInputError, match="page_size 1"):
        radix_values(cache)
    with pytest.raises(DefragInputError, match="'cache'"):
        radix_values(SimpleNamespace(page_size=1))


def test_allocator_free_list_round_trip():
    _, _, alloc, _ = sglang_state()
    free = allocator_free_slots(alloc)
    assert free.numel() == alloc.free_pages.numel() + alloc.release_pages.numel()
    set_allocator_free_slots(alloc, free.flip(0))
    assert torch.equal(alloc.free_pages, torch.sort(free).values) and alloc.release_pages.numel() == 0
    alloc.free_group = [torch.tensor([5])]
    with pytest.raises(DefragInputError, match="free group"):
        allocator_free_slots(alloc)


def test_defrag_sglang_remaps_tree_and_allocator():
    kv_pool, r2t_pool, alloc, only = sglang_state()
    r2t = r2t_pool.req_to_token
    req1 = r2t[1, :100].long()
    cache = FakeRadixCache(req1[:40], req1[40:70], only)
    before = [[t[r2t[r, :n].long()].clone() for t in kv_pool.kv_buffer] for r, n in ((1, 100), (2, 60))]
    only_kv = [t[only].clone() for t in kv_pool.kv_buffer]
    free_n = allocator_free_slots(alloc).numel()
    res = defrag_sglang(kv_pool, r2t_pool, alloc, [1, 2], [100, 60], tree_cache=cache)
    assert res.moved_slots > 0
    new1 = r2t[1, :100].long()
    for (r, n), kvs in zip(((1, 100), (2, 60)), before, strict=True):
        assert all(torch.equal(t[r2t[r, :n].long()], s) for t, s in zip(kv_pool.kv_buffer, kvs, strict=True))
    a, b, c, d = cache.nodes
    assert torch.equal(a.value, new1[:40]) and torch.equal(b.value, new1[40:70])
    assert c.value is None and torch.equal(d.value, only)
    assert all(torch.equal(t[d.value], s) for t, s in zip(kv_pool.kv_buffer, only_kv, strict=True))
    assert alloc.free_pages.numel() == free_n and alloc.release_pages.numel() == 0
    assert not bool(torch.isin(alloc.free_pages, torch.cat([new1, r2t[2, :60].long(), only])).any())
    again = defrag_sglang(kv_pool, r2t_pool, alloc, [1, 2], [100, 60], tree_cache=cache)
    assert again.moved_slots == 0


def _real_radix_cache():
    try:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    except Exception as e:  # sglang installed without its runtime dependencies
        pytest.skip(f"sglang's RadixCache does not import here: {type(e).__name__}: {e}")
    return RadixCache, RadixKey, InsertParams, MatchPrefixParams


@pytest.mark.sglang
def test_real_radix_cache_follows_the_move():
    RadixCache, RadixKey, InsertParams, MatchPrefixParams = _real_radix_cache()
    kv_pool, r2t_pool, alloc, only = sglang_state(1)
    r2t = r2t_pool.req_to_token
    cache = RadixCache.create_simulated()
    toks1 = list(range(1000, 1100))
    cache.insert(InsertParams(key=RadixKey(token_ids=toks1[:70]), value=r2t[1, :70].long().clone()))
    cache.insert(InsertParams(key=RadixKey(token_ids=[7, 8, 9]), value=only[:3].clone()))
    cache.insert(InsertParams(key=RadixKey(token_ids=toks1[:30] + [5, 6]), value=torch.cat(
        [r2t[1, :30].long(), only[3:5]])))  # splits the first node
    res = defrag_sglang(kv_pool, r2t_pool, alloc, [1, 2], [100, 60], tree_cache=cache)
    assert res.moved_slots > 0
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=toks1[:70])))
    assert m.device_prefix_len == 70
    assert torch.equal(cache.path_device_indices(m.last_device_node), r2t[1, :70].long())
    m2 = cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=[7, 8, 9])))
    assert torch.equal(cache.path_device_indices(m2.last_device_node), only[:3])
