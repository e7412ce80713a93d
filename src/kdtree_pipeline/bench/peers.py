"""The systems the bench times, behind one interface.

Each adapter has a ``name``, a table ``label``, ``supports_trees`` (False: it
runs chain masks only), :meth:`~Peer.check` (None when importable, else the
import error text) and :meth:`~Peer.prepare` (batch -> a callable that runs one
verify call on the current stream and returns its output, ``[T, H, 512]`` or a
view-compatible shape such as FlashMLA's ``[bs, N, H, 512]``).
``prepare`` allocates what the call needs (the output is poisoned with NaN so
an element the call does not write fails the correctness check) and raises
:class:`PeerUnsupported` for a case the peer cannot do. The callables do no
host synchronisation of their own, so they can be captured in a CUDA graph
(a peer that cannot be captured is timed eagerly and the report says so).

- ``ours``: :func:`kdtree_engine.kernel.op.verify_attention` with ``out=``
  preallocated and the ``max_prefix_len`` host hint, the batch's longest prefix (none
  for a case built with ``hint=False``: ``batch.meta["hint"]``, as the SGLang plugin
  under graph capture). Where the batch takes the batch schedule, the step plan
  (:class:`~kdtree_engine.kernel.op.VerifyPlan`) is made once in ``prepare``, outside the
  timed calls, and every timed call reads it: the model's layers after the step's first, as
  FlashMLA's calls read the metadata ``get_mla_metadata`` made once (``flashmla`` below).
  ``ours-make`` makes it again in every call (the step's first layer: what the plan kernel adds).
- ``sglang-extend``: SGLang's ``extend_attention_fwd``, called as
  ``TritonAttnBackend.forward_extend`` calls it for TARGET_VERIFY
  (docs/design.md section 5): q [T,H,576], k = k_ext [T,1,576], v = k_ext[..., :512], o,
  k_buffer = pool, v_buffer = pool[..., :512], qo_indptr, kv_indptr,
  kv_indices, custom_mask, is_causal=True, mask_indptr, max_len_extend = N,
  k_scale 1.0, v_scale 1.0, sm_scale.
- ``sglang-splitkv``: SGLang's ``verify_shared_kv_fwd`` (grouped-head split-KV,
  topk == 1 chains only), same arguments; it returns False for a case its
  ``can_handle`` refuses, reported as unsupported.
- ``flashmla``: FlashMLA dense decode from the sgl-flash-mla wheel
  (``flash_mla_with_kvcache(..., causal=True, use_legacy=True)``) on the chain:
  a paged bf16 cache [blocks, 64, 1, 576] holding each request's prefix and then
  its drafts' latents, ``cache_seqlens`` = that request's prefix + N, q [bs, N, H, 576].

Every adapter reads each request's length from the batch (``prefix_lens``, the
indptrs), so a ragged batch reaches each peer as SGLang would hand it over.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from kdtree_pipeline.oracle import workloads

V_DIM = 512
FLASHMLA_PAGE = 64

Runner = Callable[[], torch.Tensor]


class PeerUnsupported(RuntimeError):
    """The peer cannot run this case (reported as "unsupported", not as a time)."""


def _nan_out(b: workloads.Batch) -> torch.Tensor:
    T, H = b.q.shape[0], b.q.shape[1]
    return torch.full((T, H, V_DIM), float("nan"), dtype=torch.bfloat16, device=b.q.device)


def _import_error(module: str, attr: str | None = None) -> str | None:
    try:
        mod = importlib.import_module(module)
        if attr is not None:
            getattr(mod, attr)
    except Exception as e:  # ImportError, OSError from a shared library, AttributeError, ...
        return f"{type(e).__name__}: {e}"
    return None


class Peer:
    name = ""
    label = ""
    supports_trees = True

    def check(self) -> str | None:
        """None when the system can be imported here, else why not."""
        raise NotImplementedError

    def prepare(self, batch: workloads.Batch) -> Runner:
        raise NotImplementedError

    def masks(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        """The masks of ``wanted`` this system runs."""
        ok = ("tree", "chain") if self.supports_trees else ("chain",)
        return tuple(m for m in wanted if m in ok)


class Ours(Peer):
    name = "ours"
    label = "ours"
    #: the op's ``target``: native (what this GPU runs)
    target = "native"

    def check(self) -> str | None:
        try:
            from kdtree_engine.kernel import library
            from kdtree_engine.kernel.op import TARGETS

            lib = library.load()
            lib.device_config(torch.cuda.current_device(), TARGETS[self.target])  # refuses what cannot run here
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    #: make the step plan in every timed call (the step's first layer) instead of once in prepare
    make_each_call = False

    def prepare(self, batch: workloads.Batch) -> Runner:
        from kdtree_engine.kernel import library
        from kdtree_engine.kernel.op import VerifyPlan, verify_attention

        out = _nan_out(batch)
        args = batch.kernel_args()
        hint = max(batch.prefix_lens, default=0) if batch.meta.get("hint", True) else None
        target = self.target
        # an ABI 2 library (an A/B run against an older build) takes no plan
        plan = VerifyPlan(out.device) if out.is_cuda and library.load().has_plan else None
        make = self.make_each_call
        if plan is not None and not make:  # once, as the step's first layer would
            verify_attention(*args, out=out, max_prefix_len=hint, target=target, plan=plan, make_plan=True)
            out.fill_(float("nan"))  # the timed calls must write every element themselves

        def run() -> torch.Tensor:
            return verify_attention(*args, out=out, max_prefix_len=hint, target=target, plan=plan,
                                    make_plan=make and plan is not None)

        return run


class OursMakePlan(Ours):
    """``ours`` with the step plan made in every call: the step's first layer."""

    name = "ours-make"
    label = "ours (plan made in the call)"
    make_each_call = True


class OursSM120(Ours):
    """The owned kernel as an sm_120 GPU (RTX PRO 6000 Blackwell) runs it: its kernel
    and tile, its shared-memory limits and occupancy, on this GPU (emulation)."""

    name = "ours-sm120"
    label = "ours (sm_120 emulation)"
    target = "sm_120"


def _sglang_args(b: workloads.Batch) -> tuple[torch.Tensor, tuple]:
    """(out, positional args) of SGLang's extend_attention_fwd and verify_shared_kv_fwd,
    which take the same leading arguments: V is the first 512 columns of the latents."""
    o = _nan_out(b)
    return o, (b.q, b.k_ext, b.k_ext[..., :V_DIM], o, b.kv_buffer, b.kv_buffer[..., :V_DIM], b.qo_indptr,
               b.kv_indptr, b.kv_indices, b.custom_mask, True, b.mask_indptr, b.max_n, 1.0, 1.0)


class SGLangExtend(Peer):
    name = "sglang-extend"
    label = "SGLang extend"
    module = "sglang.kernels.ops.attention.extend_attention"

    def check(self) -> str | None:
        return _import_error(self.module, "extend_attention_fwd")

    def masks(self, wanted: tuple[str, ...]) -> tuple[str, ...]:
        """One mask: its time does not depend on it (the slow peer runs once per
        case); the tree, what SGLang runs for EAGLE top-k > 1, when the case has one."""
        return ("tree",) if "tree" in wanted else tuple(wanted[:1])

    def prepare(self, batch: workloads.Batch) -> Runner:
        fwd = importlib.import_module(self.module).extend_attention_fwd
        o, args = _sglang_args(batch)

        def run() -> torch.Tensor:
            fwd(*args, sm_scale=batch.sm_scale)
            return o

        return run


class SGLangSplitKV(Peer):
    name = "sglang-splitkv"
    label = "SGLang split-KV"
    supports_trees = False
    module = "sglang.kernels.ops.attention.verify_mla"

    def check(self) -> str | None:
        return _import_error(self.module, "verify_shared_kv_fwd")

    def prepare(self, batch: workloads.Batch) -> Runner:
        mod = importlib.import_module(self.module)
        o, args = _sglang_args(batch)
        can = getattr(mod, "can_handle", None)
        if can is not None and not can(*args[:3], *args[4:13]):
            raise PeerUnsupported("verify_mla.can_handle returned False for this case")

        def run() -> torch.Tensor:
            if not mod.verify_shared_kv_fwd(*args, sm_scale=batch.sm_scale):
                raise PeerUnsupported("verify_shared_kv_fwd returned False (cannot handle this case)")
            return o

        return run


def paged_chain_cache(batch: workloads.Batch, page: int = FLASHMLA_PAGE,
                      seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's inputs for a chain batch: (k_cache [blocks, page, 1, 576],
    block_table int32 [bs, max_blocks], cache_seqlens int32 [bs]).

    Request b's cache holds its prefix latents in order, then its drafts'
    latents (k_ext), so that a causal s_q = N decode is the chain verify. The
    blocks are placed in a random order (a paged pool); the tail of each last
    block holds random filler."""
    dev = batch.q.device
    qo = [0]
    for n in batch.n_drafts:
        qo.append(qo[-1] + n)
    kv_off = 0
    chunks, nblocks, lens = [], [], []
    pool = batch.kv_buffer.reshape(batch.kv_buffer.shape[0], -1)
    ext = batch.k_ext.reshape(batch.k_ext.shape[0], -1)
    g = torch.Generator(device=dev).manual_seed(seed + 11)
    for b, L in enumerate(batch.prefix_lens):
        slots = batch.kv_indices[kv_off: kv_off + L]
        kv_off += L
        toks = torch.cat([pool[slots.long()], ext[qo[b]: qo[b + 1]]])
        nb = -(-toks.shape[0] // page)
        pad = nb * page - toks.shape[0]
        if pad:
            toks = torch.cat([toks, torch.randn((pad, toks.shape[1]), generator=g, device=dev,
                                                dtype=toks.dtype)])
        chunks.append(toks)
        nblocks.append(nb)
        lens.append(L + qo[b + 1] - qo[b])
    blocks = torch.cat(chunks).view(-1, page, 1, pool.shape[1])
    total = blocks.shape[0]
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 12)).to(dev)
    k_cache = torch.empty_like(blocks)
    k_cache[perm] = blocks
    table = torch.zeros((len(nblocks), max(nblocks, default=1)), dtype=torch.int32, device=dev)
    start = 0
    for b, nb in enumerate(nblocks):
        table[b, :nb] = perm[start: start + nb].to(torch.int32)
        start += nb
    return k_cache, table, torch.tensor(lens, dtype=torch.int32, device=dev)


class FlashMLA(Peer):
    name = "flashmla"
    label = "FlashMLA"
    supports_trees = False
    module = "flash_mla"

    def check(self) -> str | None:
        err = _import_error(self.module, "flash_mla_with_kvcache")
        if err:
            return err
        mod = importlib.import_module(self.module)
        has_legacy = getattr(mod, "has_legacy", None)
        if has_legacy is not None and not has_legacy():
            return "flash_mla imports but its legacy (SM90 dense decode) kernels are not available"
        return None

    def prepare(self, batch: workloads.Batch) -> Runner:
        fm = importlib.import_module(self.module)
        ns = set(batch.n_drafts)
        if len(ns) != 1:
            raise PeerUnsupported("FlashMLA's q [b, s_q, h, 576] needs the same draft count in every request")
        n = ns.pop()
        bs, H = batch.bs, batch.q.shape[1]
        q4 = batch.q.view(bs, n, H, batch.q.shape[2])
        k_cache, table, seqlens = paged_chain_cache(batch)
        meta, num_splits = fm.get_mla_metadata(seqlens, n * H, 1)

        def run() -> torch.Tensor:  # out [bs, N, H, 512]; the checker reshapes it (no copy in the timed call)
            out, _ = fm.flash_mla_with_kvcache(q4, k_cache, table, seqlens, V_DIM, meta, num_splits,
                                               softmax_scale=batch.sm_scale, causal=True, use_legacy=True)
            return out

        return run


PEERS: dict[str, Peer] = {p.name: p for p in (Ours(), OursMakePlan(), OursSM120(), SGLangExtend(), SGLangSplitKV(), FlashMLA())}
