"""Thin adapters between :mod:`kdtree_engine.defrag.compact` and SGLang's objects.

Duck-typed on the attributes SGLang 0.5.23 uses, so nothing here imports
sglang:

* ``RadixCache.root_node``: ``TreeNode`` with ``children`` (dict of TreeNode),
  ``value`` (int64 tensor of slot ids; ``None`` once evicted; the root holds
  ``[]``), and ``RadixCache.page_size``.
* ``TokenToKVPoolAllocator``: ``free_pages`` and ``release_pages`` (int64 slot
  ids; with ``need_sort`` frees go to ``release_pages`` first) and
  ``free_group`` (not ``None`` while a group of frees is being collected).
* ``MLATokenToKVPool``: ``kv_buffer`` (list, one ``[size + page_size, 1, 576]``
  tensor per layer), ``size``, ``page_size``.
* ``ReqToTokenPool.req_to_token``: ``[rows, max_context]`` int32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kdtree_engine.defrag.compact import DefragInputError, DefragResult, Strategy, defrag


def _page_size_one(name: str, obj: Any) -> None:
    ps = getattr(obj, "page_size", 1)
    if ps != 1:
        raise DefragInputError(f"defrag: argument '{name}': expected page_size 1 (slot ids are token ids), got {ps}")


def radix_values(cache: Any) -> list[torch.Tensor]:
    """Every ``TreeNode.value`` tensor of an SGLang ``RadixCache`` (depth first,
    children in insertion order); evicted nodes and the root are skipped.

    The tensors are the tree's own (remapping them in place updates the tree).
    """
    _page_size_one("cache", cache)
    root = getattr(cache, "root_node", None)
    if root is None or not hasattr(root, "children"):
        raise DefragInputError(
            f"defrag: argument 'cache': expected a radix cache with a root_node, got {type(cache).__name__}"
        )
    out: list[torch.Tensor] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node is not root and isinstance(node.value, torch.Tensor) and node.value.numel():
            out.append(node.value)
        stack.extend(reversed(list(node.children.values())))
    return out


def allocator_free_slots(allocator: Any) -> torch.Tensor:
    """The allocator's whole free set: ``cat(free_pages, release_pages)``."""
    if getattr(allocator, "free_group", None) is not None:
        raise DefragInputError(
            "defrag: argument 'allocator': expected no free group in progress (free_group_end() first), "
            "got an open free group"
        )
    free = allocator.free_pages
    rel = getattr(allocator, "release_pages", None)
    return torch.cat([free, rel]) if rel is not None and rel.numel() else free


def set_allocator_free_slots(allocator: Any, free_slots: torch.Tensor) -> None:
    """Replace the allocator's free list (sorted ascending, as ``merge_and_sort_free`` leaves it)."""
    dev = allocator.free_pages.device
    allocator.free_pages = torch.sort(free_slots.to(device=dev, dtype=torch.int64)).values
    if getattr(allocator, "release_pages", None) is not None:
        allocator.release_pages = torch.empty((0,), dtype=torch.int64, device=dev)


def defrag_sglang(
    kv_pool: Any,
    req_to_token_pool: Any,
    allocator: Any,
    req_pool_indices: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    tree_cache: Any | None = None,
    extra_holders: Sequence[torch.Tensor] = (),
    *,
    strategy: Strategy = "runs",
    allow_shared: bool = True,
) -> DefragResult:
    """Compact the KV of the running requests of one SGLang scheduler.

    Call between scheduler steps, on the model's stream, with nothing prepared
    from the old slot ids (see :mod:`kdtree_engine.defrag.compact`). Shared
    radix prefixes are allowed (``allow_shared``); their slots stay in place.
    ``extra_holders`` are any other slot-id tensors to remap (e.g. live
    requests' ``prefix_indices``). The allocator's free list is replaced.
    """
    _page_size_one("kv_pool", kv_pool)
    holders = list(radix_values(tree_cache)) if tree_cache is not None else []
    holders += list(extra_holders)
    free = allocator_free_slots(allocator)
    result = defrag(kv_pool.kv_buffer, req_to_token_pool.req_to_token, req_pool_indices, seq_lens, free,
                    holders, strategy=strategy, allow_shared=allow_shared)
    set_allocator_free_slots(allocator, result.free_slots)
    return result
