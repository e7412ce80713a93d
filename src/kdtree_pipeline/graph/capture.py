"""Capture the verify kernel in a CUDA graph and replay it with new metadata.

:class:`VerifyGraph` is what a serving engine does with a captured verify
step, in miniature: fixed-address buffers sized for the captured maximum
(batch, drafts per request, total prefix tokens), one capture, then for each
step :meth:`VerifyGraph.load` writes the step's values into the same buffers
(like SGLang's ``_update_target_verify_buffers``) and :meth:`replay` runs it.

What can be checked without a device sync is checked on the host in
:meth:`load`, before anything is written: a batch larger than captured, a
request with more drafts than captured, a total prefix or mask beyond the
buffers' capacity, a different head count, pool or dtype. Buffers reallocated
after capture cannot be seen from here; the graph keeps the addresses it
captured, so the caller must keep them alive and in place (that is the
contract, and :meth:`check_addresses` verifies it for the buffers we own).
Padded requests (SGLang pads a batch to the captured size) get a prefix of
one token on slot 0, the padding slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from kdtree_engine.kernel.op import VerifyArgumentError, verify_attention
from kdtree_pipeline.oracle.workloads import Batch

T = TypeVar("T")


def capture_graph(body: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``body`` once on a side stream (allocator and library warm-up outside the
    capture, as torch requires), then capture it in a CUDA graph; returns the graph
    and what the captured ``body`` returned (its outputs, rewritten by each replay)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = body()
    return g, out


@dataclass(frozen=True)
class Capacity:
    max_bs: int
    max_n: int
    max_prefix_tokens: int  # sum of prefix lengths over the batch
    num_heads: int
    max_prefix_len: int  # longest single prefix (tunes the split count)

    @property
    def max_tokens(self) -> int:
        return self.max_bs * self.max_n

    @property
    def max_mask(self) -> int:
        return self.max_n * (self.max_prefix_tokens + self.max_bs) + self.max_bs * self.max_n * self.max_n


def check_fits(cap: Capacity, batch: Batch) -> None:
    """Host-side checks of a step against the captured capacity; raises naming what does not fit."""
    bs = batch.bs
    if bs > cap.max_bs:
        raise VerifyArgumentError(f"graph replay: batch of {bs} requests, captured for at most {cap.max_bs}")
    if batch.q.shape[1] != cap.num_heads:
        raise VerifyArgumentError(f"graph replay: {batch.q.shape[1]} heads, captured for {cap.num_heads}")
    if any(n != cap.max_n for n in batch.n_drafts):
        raise VerifyArgumentError(
            f"graph replay: drafts per request {sorted(set(batch.n_drafts))}, captured for exactly {cap.max_n} "
            "(a verify graph has a fixed number of draft tokens per request)")
    total = sum(batch.prefix_lens) + (cap.max_bs - bs)  # padded requests take one slot each
    if total > cap.max_prefix_tokens:
        raise VerifyArgumentError(
            f"graph replay: {total} prefix tokens (with padding), captured capacity {cap.max_prefix_tokens}")
    if max(batch.prefix_lens, default=0) > cap.max_prefix_len:
        raise VerifyArgumentError(
            f"graph replay: a prefix of {max(batch.prefix_lens)} tokens, captured for at most {cap.max_prefix_len}")
    if batch.custom_mask.numel() > cap.max_mask:
        raise VerifyArgumentError(f"graph replay: mask of {batch.custom_mask.numel()} entries, capacity {cap.max_mask}")


class VerifyGraph:
    """A captured verify call over fixed buffers (one KV pool, given at construction)."""

    def __init__(self, kv_buffer: torch.Tensor, cap: Capacity, sm_scale: float, num_splits: int | None = None):
        dev = kv_buffer.device
        self.cap = cap
        self.kv_buffer = kv_buffer
        self.sm_scale = float(sm_scale)
        T = cap.max_tokens
        self.q = torch.zeros((T, cap.num_heads, 576), dtype=torch.bfloat16, device=dev)
        self.k_ext = torch.zeros((T, 1, 576), dtype=torch.bfloat16, device=dev)
        self.qo_indptr = torch.arange(0, T + 1, cap.max_n, dtype=torch.int32, device=dev)
        self.kv_indptr = torch.arange(0, cap.max_bs + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(cap.max_prefix_tokens, dtype=torch.int64, device=dev)
        self.custom_mask = torch.ones(cap.max_mask, dtype=torch.uint8, device=dev)
        self.mask_indptr = torch.zeros(cap.max_bs + 1, dtype=torch.int64, device=dev)
        self.mask_indptr[1:] = torch.arange(1, cap.max_bs + 1, device=dev) * cap.max_n * (1 + cap.max_n)
        self.out = torch.zeros((T, cap.num_heads, 512), dtype=torch.bfloat16, device=dev)
        self.lse = torch.zeros((T, cap.num_heads), dtype=torch.float32, device=dev)
        self.num_splits = num_splits
        self.graph: torch.cuda.CUDAGraph | None = None
        self._addresses: dict[str, int] = {}

    def _call(self) -> None:
        verify_attention(self.q, self.k_ext, self.kv_buffer, self.qo_indptr, self.kv_indptr, self.kv_indices,
                         self.custom_mask, self.mask_indptr, self.sm_scale, self.cap.max_n, out=self.out,
                         lse=self.lse, num_splits=self.num_splits, max_prefix_len=self.cap.max_prefix_len)

    def capture(self) -> None:
        self._call()  # warm up: loads the library, sizes the workspace
        torch.cuda.synchronize()
        self.graph, _ = capture_graph(self._call)
        self._addresses = {k: getattr(self, k).data_ptr() for k in
                           ("q", "k_ext", "qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr",
                            "out", "lse", "kv_buffer")}

    def check_addresses(self) -> None:
        for k, ptr in self._addresses.items():
            if getattr(self, k).data_ptr() != ptr:
                raise VerifyArgumentError(f"graph replay: buffer '{k}' was reallocated after capture")

    def load(self, batch: Batch) -> None:
        """Write one step's values into the captured buffers (host checks first)."""
        check_fits(self.cap, batch)
        if batch.kv_buffer.data_ptr() != self.kv_buffer.data_ptr():
            raise VerifyArgumentError("graph replay: the batch uses another KV pool than the captured one")
        cap, bs, n = self.cap, batch.bs, self.cap.max_n
        T = bs * n
        self.q[:T].copy_(batch.q)
        self.k_ext[:T].copy_(batch.k_ext)
        lens = list(batch.prefix_lens) + [1] * (cap.max_bs - bs)  # padding: one token on slot 0
        kv = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
        self.kv_indptr.copy_(kv.to(torch.int32), non_blocking=True)
        used = sum(batch.prefix_lens)
        self.kv_indices[:used].copy_(batch.kv_indices.to(torch.int64))
        self.kv_indices[used : used + cap.max_bs - bs].zero_()
        mi = torch.tensor([0] + [n * (L + n) for L in lens], dtype=torch.int64).cumsum(0)
        self.mask_indptr.copy_(mi, non_blocking=True)
        m = batch.custom_mask.to(torch.uint8)
        self.custom_mask[: m.numel()].copy_(m)
        pad = torch.ones((n, 1 + n), dtype=torch.uint8, device=m.device).tril(1)  # padded rows: a chain
        for i in range(cap.max_bs - bs):
            start = int(mi[bs + i])
            self.custom_mask[start : start + pad.numel()].copy_(pad.reshape(-1))

    def replay(self) -> None:
        if self.graph is None:
            raise RuntimeError("VerifyGraph.replay before capture()")
        self.check_addresses()
        self.graph.replay()
