"""The verify-attention op: argument checks, workspace, launch, torch custom op.

Public entry point: :func:`verify_attention`. It checks every argument that
can be checked without reading device memory (dtype, shape, device, strides,
alignment, limits, lengths), raises :class:`VerifyArgumentError` naming the
argument before anything is launched, and then calls the kernel library on
``torch.cuda.current_stream()``. No host synchronisation and no host read of
tensor values happen on this path, so the call can be captured in a CUDA graph.

Slot ids, indptr contents and mask extents live on the device. The kernel
never reads outside the tensors it is given; it records violations in an
error word. With ``KDTREE_DEBUG=1`` the op also checks those values on the host
before the launch and reads the error word after it (both synchronise), and
raises on any violation.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from kdtree_engine.kernel import library
from kdtree_engine.kernel.errors import VerifyArgumentError, argument_error
from kdtree_engine.kernel.library import TARGETS, resolve_target

__all__ = ["TARGETS", "VerifyArgumentError", "VerifyPlan", "resolve_target", "verify_attention"]

HEAD_DIM = 576
V_DIM = 512
MAX_HEADS = 128
MAX_DRAFTS = 128

#: ``torch.library`` name of the op (one op under ``torch.compile`` and graph capture).
OP_NAME = "kdtree::verify_attention"
#: bytes of workspace header (csrc/common.cuh WS_HEADER): zero when a workspace is first used
WS_HEADER = 256
#: a request of K keys takes ceil(K / SPLIT_MIN_KEYS) splits at most (csrc/common.cuh, the device's rule)
SPLIT_MIN_KEYS = 128
#: the most splits a request takes, whatever the grid (csrc/common.cuh: the combine's shared memory)
MAX_SPLITS = 1024


def split_plan(kv: int, num_splits: int, split_keys: int) -> tuple[int, int]:
    """csrc/common.cuh ``split_plan``, the schedule every CTA computes on the device: (splits,
    steps of ``split_keys`` keys per split) of a request of ``kv`` keys (prefix and drafts)
    under a grid of ``num_splits``. ceil(kv / SPLIT_MIN_KEYS) splits, at most ``num_splits``
    and MAX_SPLITS, then trimmed so that every split is non-empty; ``split_keys`` is the
    kernel's step (Params::split_keys: a 32-key tile, or the sm90 kernel's 128-key pair of
    blocks). tests/test_kernel_op.py checks it against the compiled C++."""
    want = max(1, min(num_splits, MAX_SPLITS, -(-kv // SPLIT_MIN_KEYS)))
    steps = max(1, -(-kv // split_keys))
    per = -(-steps // want)
    return -(-steps // per), per


#: rows per CTA of the batch schedule's kernels (csrc/common.cuh PLAN_BM)
PLAN_BM = 64
#: the most requests the batch schedule takes; more run on the 3-D grid (csrc/common.cuh PLAN_MAX_BS)
PLAN_MAX_BS = 128


def batch_plan(prefix_lens: Sequence[int], n_drafts: Sequence[int], num_heads: int, split_keys: int,
               budget: int) -> list[tuple[int, int]]:
    """csrc/common.cuh ``batch_plan``, the batch schedule warp 0 of each CTA computes on the
    device for a batch of more than one request: (splits, first partial row) per request, as
    the request's first CTA writes them for the combine (Params::plan_meta). Every request
    takes ceil(steps / per) splits of ``per`` steps, ``per`` the smallest (at least
    SPLIT_MIN_KEYS keys) for which the CTAs, sum of row tiles x splits, fit ``budget``; a
    request of several splits owns splits x rows partial rows, packed in request order (one
    of one split owns none; its slot is where the next one's begin). tests/test_kernel_op.py
    checks the device's against this."""
    rows = [n * num_heads for n in n_drafts]
    steps = [max(1, -(-(L + n) // split_keys)) for L, n in zip(prefix_lens, n_drafts, strict=True)]
    tiles = [-(-r // PLAN_BM) for r in rows]
    work, ntiles = sum(t * s for t, s in zip(tiles, steps, strict=True)), sum(tiles)
    smax = max([s for t, s in zip(tiles, steps, strict=True) if t > 0], default=1)
    per_min = -(-SPLIT_MIN_KEYS // split_keys)
    per = max(per_min, smax)
    if budget > ntiles:
        lo = max(per_min, min(smax, -(-work // budget)))
        hi = max(lo, min(smax, -(-work // (budget - ntiles))))
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(t * -(-s // mid) for t, s in zip(tiles, steps, strict=True)) <= budget:
                hi = mid
            else:
                lo = mid + 1
        per = lo
    out, slot = [], 0
    for r, s in zip(rows, steps, strict=True):
        sp = -(-s // per)
        out.append((sp, slot))
        slot += sp * r if sp > 1 else 0
    return out


#: bytes after the header for the batch schedule's (slot, splits) pairs (csrc/common.cuh WS_PLAN_BYTES)
WS_PLAN_BYTES = 1024
#: partial rows of the workspace per row and split of the grid (csrc/common.cuh WS_PART_FACTOR)
WS_PART_FACTOR = 2


def split_budget(bs: int, total_rows: int, num_splits: int, sm_count: int, row_tiles: int) -> int:
    """csrc/kdtree_verify.cu's batch schedule budget: the CTAs (one per SM, at most what the
    workspace's ``total_rows`` x ``num_splits`` x WS_PART_FACTOR partial rows hold at PLAN_BM rows a CTA, and
    MAX_SPLITS) a call of ``bs`` requests shares, or 0 where it takes the 3-D grid (one request,
    one split, more than 128 requests, or a budget the batch's ``row_tiles`` fill)."""
    budget = min(sm_count, total_rows * num_splits * WS_PART_FACTOR // PLAN_BM, MAX_SPLITS)
    planned = 1 < bs <= PLAN_MAX_BS and num_splits > 1 and budget > row_tiles
    return budget if planned else 0


def workspace_layout(total_rows: int, num_splits: int) -> dict[str, int]:
    """Byte offsets of the workspace's parts for a call of ``total_rows`` (T x H) rows and
    ``num_splits`` (csrc/kdtree_verify.cu, the library's kdtree_workspace_bytes): the header,
    the batch schedule's (slot, splits) pairs (``plan``), the bf16 partials (``parts``), their
    fp32 LSEs (``lse``), the combine's int32 arrival counters, one per partial row of split 0
    (``counters``, Params::plan_cnt), and the ``end``. For tests that read what the kernels left
    there; tests/test_kernel_op.py checks ``end`` against the library."""
    parts = WS_HEADER + WS_PLAN_BYTES
    prow = total_rows * num_splits * WS_PART_FACTOR  # partial rows (csrc/common.cuh WS_PART_FACTOR)
    lse = parts + prow * V_DIM * 2
    aligned = -(-(prow * 4) // 256) * 256
    return {"plan": WS_HEADER, "parts": parts, "lse": lse, "counters": lse + aligned, "end": lse + 2 * aligned}


# Groups of 64 threads in a CTA of the batch schedule's narrow combine (csrc/combine.cuh
# COMBINE_NARROW_ROWS): a row of at most this many chunks is merged within one CTA.
COMBINE_GROUPS = 8


def piece_splits(num_splits: int) -> int | None:
    """Splits one piece of the batch schedule's narrow combine merges (csrc/combine.cuh
    PIECE_SPLITS, sm_90's: the instance is the smallest of 2, 4, 8, 16 that holds the grid's
    ``num_splits``); None past 16 (the one-pass and wide kernels take those)."""
    for maxs, k in ((2, 4), (4, 8), (8, 8), (16, 16)):
        if num_splits <= maxs:
            return k
    return None


def debug_enabled() -> bool:
    return os.environ.get("KDTREE_DEBUG", "").lower() in ("1", "on", "true", "yes")




@dataclass(frozen=True)
class Shapes:
    """What the checks learned about a call (all host-side facts)."""

    bs: int
    total_tokens: int
    num_heads: int
    max_n: int
    pool_size: int


class VerifyPlan:
    """A step plan: the batch schedule of one verify step, made by the step's first call
    (``verify_attention(..., plan=plan, make_plan=True)``: a small kernel before that call's
    own) and read by the step's other calls (``plan=plan``: the model's other layers, with
    the same batch and the same lengths), as FlashMLA's calls read what its
    ``get_mla_metadata`` made once per step. Each main-kernel CTA then reads its job with one
    load instead of deriving it from every request's lengths (csrc/plan.cu).

    The buffer (``buffer``, the library's kdtree_plan_bytes) lives on ``device``; the host
    keeps the shape of the call that made it (``key``), and a call of another shape is refused
    before anything launches. The lengths stay on the device: a call whose lengths differ from
    the making call's sets the kernel's plan error bit (raised under ``KDTREE_DEBUG=1``) and
    leaves the rows the plan does not cover unwritten, so make the plan again whenever the
    batch's lengths change (each step). Calls that do not use the batch schedule (one request,
    or a batch that fills the GPU) neither make nor read it. Under CUDA-graph capture the
    making call's plan kernel is captured with it, so each replay plans from the lengths it
    replays."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        # an int is a CUDA ordinal; a device without an index is the current one
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if dev.type != "cuda":
            raise argument_error("device", "a CUDA device for the plan", str(dev))
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        lib = library.load()
        if not lib.has_plan:
            raise library.KernelLibraryError(f"kernel library {lib.path} (ABI {lib.abi}) takes no step plan; rebuild it")
        self.device = dev
        self.buffer = torch.zeros(lib.plan_bytes, dtype=torch.uint8, device=dev)
        #: (target, bs, num_heads, max_n, total_tokens, num_splits) of the call that made it; None until then
        self.key: tuple[int, int, int, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"VerifyPlan(device={self.device}, made_for={_describe_plan_key(self.key)})"


def _describe_plan_key(key: tuple[int, ...] | None) -> str:
    if key is None:
        return "nothing (never made)"
    target, bs, h, n, t = key[:5]
    splits = f" num_splits={key[5]}" if len(key) > 5 else ""
    return f"bs={bs} num_heads={h} max_n={n} total_tokens={t}{splits} target={target}"


def _check_dtype(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise argument_error(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        raise argument_error(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)


def _latent_rows(name: str, t: torch.Tensor) -> tuple[int, int]:
    """[R, 1, 576] or [R, 576] -> (R, row stride in elements)."""
    if t.dim() == 3 and t.shape[1] == 1 and t.shape[2] == HEAD_DIM:
        return t.shape[0], t.stride(0)
    if t.dim() == 2 and t.shape[1] == HEAD_DIM:
        return t.shape[0], t.stride(0)
    raise argument_error(name, f"shape [rows, 1, {HEAD_DIM}] or [rows, {HEAD_DIM}]", list(t.shape))


def _has_memory(t: torch.Tensor) -> bool:
    """Does ``t`` have real memory (an address)? Fake tensors (torch.compile's tracing,
    ``torch.library.opcheck``) and meta tensors have none: address checks are skipped
    for them and run again on the real tensors at the call."""
    if t.device.type == "meta" or torch.compiler.is_compiling():  # dynamo traces fake tensors
        return False
    return not is_fake(t)


def _check_rows(name: str, t: torch.Tensor, row_strides: Sequence[int]) -> None:
    """Last dim contiguous, 16-byte aligned rows (the kernel moves 16 bytes at a time)."""
    if t.stride(-1) != 1:
        raise argument_error(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    if t.numel() and _has_memory(t) and t.data_ptr() % 16:
        raise argument_error(name, "a 16-byte aligned data pointer", f"address {t.data_ptr():#x}")
    for s in row_strides:
        if s % 8:
            raise argument_error(name, "row strides that are multiples of 8 elements (16 bytes)", list(t.stride()))


def _check_index(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], length: int | None) -> None:
    _check_dtype(name, t, dtypes)
    if t.dim() != 1:
        raise argument_error(name, "a 1-D tensor", f"shape {list(t.shape)}")
    if length is not None and t.numel() != length:
        raise argument_error(name, f"{length} elements (batch size + 1)", t.numel())
    if not t.is_contiguous():
        raise argument_error(name, "a contiguous tensor", f"strides {list(t.stride())}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    last = sum((d - 1) * st for d, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two dense tensors of one storage share bytes? Distinct storages never
    alias; for strided views (which may interleave without sharing an element)
    only a definite overlap of two contiguous tensors is reported."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return False
    if not (_has_memory(a) and _has_memory(b)):
        return False  # no addresses to compare (fake/meta); checked on the real tensors
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (x0, x1), (y0, y1) = _span(a), _span(b)
    return x0 < y1 and y0 < x1


def check_arguments(
    q: torch.Tensor,
    k_ext: torch.Tensor,
    kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    sm_scale: float,
    max_n: int,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    prefix_lens_cpu: Sequence[int] | torch.Tensor | None = None,
    require_cuda: bool = True,
    draft_slots: torch.Tensor | None = None,
) -> Shapes:
    """Every check that needs no device read; raises :class:`VerifyArgumentError`."""
    _check_dtype("q", q, (torch.bfloat16,))
    if q.dim() != 3 or q.shape[2] != HEAD_DIM:
        raise argument_error("q", f"shape [tokens, heads, {HEAD_DIM}]", list(q.shape))
    T, H = q.shape[0], q.shape[1]
    if not 1 <= H <= MAX_HEADS:
        raise argument_error("q", f"1..{MAX_HEADS} heads (q.shape[1])", H)
    _check_rows("q", q, (q.stride(0), q.stride(1)))

    if draft_slots is not None:  # the drafts' latents are read from the pool at these slots
        _check_index("draft_slots", draft_slots, (torch.int64, torch.int32), None)
        if draft_slots.numel() != T:
            raise argument_error("draft_slots", f"{T} slot ids (one per draft token, as q.shape[0])", draft_slots.numel())
        if k_ext is not None:
            raise argument_error("k_ext", "None when draft_slots is given (the drafts come from one of them)", "a tensor")
    else:
        if k_ext is None:
            raise argument_error("k_ext", "the drafts' latents [T, 1, 576] (or draft_slots: their slots in kv_buffer)", None)
        _check_dtype("k_ext", k_ext, (torch.bfloat16,))
        rows, k_st = _latent_rows("k_ext", k_ext)
        if rows != T:
            raise argument_error("k_ext", f"{T} rows (one latent per draft token, as q.shape[0])", rows)
        _check_rows("k_ext", k_ext, (k_st,))

    _check_dtype("kv_buffer", kv_buffer, (torch.bfloat16,))
    pool, kv_st = _latent_rows("kv_buffer", kv_buffer)
    if pool < 1:
        raise argument_error("kv_buffer", "at least one slot (slot 0 is the padding slot)", pool)
    _check_rows("kv_buffer", kv_buffer, (kv_st,))

    _check_dtype("qo_indptr", qo_indptr, (torch.int32, torch.int64))
    if qo_indptr.dim() != 1 or qo_indptr.numel() < 1:
        raise argument_error("qo_indptr", "a 1-D tensor of batch size + 1 >= 1 elements", list(qo_indptr.shape))
    bs = qo_indptr.numel() - 1
    # The batch size comes from qo_indptr; when kv_indptr and mask_indptr agree on another
    # length, qo_indptr is the odd one out and the error names it.
    others = {t.numel() for t in (kv_indptr, mask_indptr) if isinstance(t, torch.Tensor) and t.dim() == 1}
    if len(others) == 1 and qo_indptr.numel() not in others:
        n = others.pop()
        raise argument_error("qo_indptr", f"{n} elements (batch size + 1, as kv_indptr and mask_indptr have)",
                   qo_indptr.numel())
    _check_index("qo_indptr", qo_indptr, (torch.int32, torch.int64), bs + 1)
    _check_index("kv_indptr", kv_indptr, (torch.int32, torch.int64), bs + 1)
    _check_index("kv_indices", kv_indices, (torch.int64, torch.int32), None)
    _check_index("custom_mask", custom_mask, (torch.bool, torch.uint8), None)
    _check_index("mask_indptr", mask_indptr, (torch.int64,), bs + 1)

    if isinstance(max_n, bool) or not isinstance(max_n, int):
        raise argument_error("max_n", "a Python int (drafts per request, SGLang's max_extend_len)", type(max_n).__name__)
    if not 0 <= max_n <= MAX_DRAFTS:
        raise argument_error("max_n", f"0..{MAX_DRAFTS} drafts per request", max_n)
    if T > bs * max_n:
        raise argument_error("max_n", f"at least q.shape[0] / batch = {T}/{bs} drafts per request", max_n)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise argument_error("sm_scale", "a positive finite float (the softmax scale)", sm_scale)

    if prefix_lens_cpu is not None:
        lens = [int(x) for x in (prefix_lens_cpu.tolist() if isinstance(prefix_lens_cpu, torch.Tensor) else prefix_lens_cpu)]
        if len(lens) != bs:
            raise argument_error("prefix_lens_cpu", f"{bs} prefix lengths (one per request)", len(lens))
        if any(x < 0 for x in lens):
            raise argument_error("prefix_lens_cpu", "non-negative prefix lengths", lens)
        if kv_indices.numel() < sum(lens):
            raise argument_error("kv_indices", f">= {sum(lens)} slot ids (the sum of prefix lengths)", kv_indices.numel())
        if T == bs * max_n:  # every request has exactly max_n drafts: the mask length is known
            need = sum(max_n * (L + max_n) for L in lens)
            if custom_mask.numel() < need:
                raise argument_error(
                    "custom_mask",
                    f">= {need} entries (sum over requests of N x (prefix + N), N = {max_n})",
                    custom_mask.numel(),
                )

    if out is not None:
        _check_dtype("out", out, (torch.bfloat16,))
        if list(out.shape) != [T, H, V_DIM]:
            raise argument_error("out", f"shape [{T}, {H}, {V_DIM}]", list(out.shape))
        _check_rows("out", out, (out.stride(0), out.stride(1)))
        for name, t in (("q", q), ("k_ext", k_ext), ("kv_buffer", kv_buffer)):
            if t is not None and _overlaps(out, t):
                raise argument_error("out", f"memory that does not overlap '{name}'", "an overlapping view")
    if lse is not None:
        _check_dtype("lse", lse, (torch.float32,))
        if list(lse.shape) != [T, H] or not lse.is_contiguous():
            raise argument_error("lse", f"a contiguous tensor of shape [{T}, {H}]", f"{list(lse.shape)} strides {list(lse.stride())}")

    if require_cuda:
        named = [("q", q), ("k_ext" if k_ext is not None else "draft_slots",
                             k_ext if k_ext is not None else draft_slots), ("kv_buffer", kv_buffer),
                 ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                 ("custom_mask", custom_mask), ("mask_indptr", mask_indptr)]
        if out is not None:
            named.append(("out", out))
        if lse is not None:
            named.append(("lse", lse))
        if q.device.type != "cuda":
            raise argument_error("q", "a CUDA tensor", q.device)
        for name, t in named:
            if t.device != q.device:
                raise argument_error(name, f"a tensor on {q.device} (where q is)", t.device)
    return Shapes(bs=bs, total_tokens=T, num_heads=H, max_n=max_n, pool_size=pool)


def choose_num_splits(
    bs: int, max_n: int, num_heads: int, sm_count: int, block_rows: int, max_prefix_len: int | None = None,
    max_splits: int = 256,
) -> int:
    """The grid's split count: the most splits any request of the call may take.

    One CTA runs per SM (its shared memory is ~156 KB), so a call takes
    ceil(ctas * splits / sm_count) waves: 17 splits of 8 row tiles (136 CTAs on
    132 SMs) would take two waves where 16 take one. So: as many splits as fit
    in one wave, none when the batch alone fills the GPU.

    The device trims this per request (csrc/common.cuh ``split_plan``, issue 16):
    each request takes ceil((prefix + N) / 128) splits at most, every one non-empty,
    from the lengths it reads; the CTAs of the splits it does not need exit at once
    and a request of one split skips the combine. So under CUDA-graph capture,
    where no hint exists, a short replayed prefix costs no empty splits.
    ``max_prefix_len`` (a host-side hint, e.g. SGLang's seq_lens_cpu) applies the
    same rule to the longest request on the host, which only shrinks the grid.
    """
    row_tiles = max(1, -(-max_n * num_heads // block_rows))
    ctas = max(1, bs * row_tiles)
    splits = max(1, sm_count // ctas)
    if max_prefix_len is not None:
        splits = min(splits, max(1, -(-(max_prefix_len + max_n) // SPLIT_MIN_KEYS)))
    return max(1, min(splits, max_splits))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _alloc_workspace(device_index: int, nbytes: int) -> torch.Tensor:
    ws = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", device_index))
    ws[:WS_HEADER].zero_()  # the header (error word, counters) starts at zero: no kernel clears it
    return ws


class _Workspaces:
    """One workspace per (device, stream), grown by doubling and never freed while
    the process runs.

    Per stream: two streams running the kernel at once must not share the split-KV
    partials and the error word (the kernel writes and reads its workspace during
    the call), while calls on one stream are ordered and can share one. The key is
    the raw stream handle (``cudaStream_t``), so the default stream, a side stream
    and a graph's capture stream each get their own.

    Never freed: a captured graph keeps the address it saw, so every buffer a
    capture may have used stays alive (``_keep``), also after growth replaced it
    for later calls. Growth is rare (the first call on a stream, then only a larger
    shape) and allowed during capture too (the buffer then comes from the graph's
    pool and is kept like any other). Two replays of graphs captured on one stream
    share that stream's workspace, so replay them on one stream, as SGLang does.
    """

    def __init__(self, alloc=_alloc_workspace) -> None:
        self._lock = threading.Lock()
        self._alloc = alloc
        self._cur: dict[tuple[int, int], torch.Tensor] = {}
        self._keep: list[torch.Tensor] = []

    def get(self, device: torch.device, nbytes: int, stream: int | None = None) -> torch.Tensor:
        """The workspace of ``stream`` (a ``cudaStream_t`` handle; default: the current
        stream of ``device``) with at least ``nbytes`` bytes."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if stream is None:
            stream = torch.cuda.current_stream(idx).cuda_stream
        key = (idx, int(stream))
        with self._lock:
            ws = self._cur.get(key)
            if ws is None or ws.numel() < nbytes:
                size = max(nbytes, 2 * (0 if ws is None else ws.numel()), 1 << 20)
                ws = self._alloc(idx, size)
                self._cur[key] = ws
                self._keep.append(ws)
            return ws


_workspaces = _Workspaces()


def _debug_check_values(q, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, pool: int, max_n: int,
                        draft_slots: torch.Tensor | None = None) -> None:
    """KDTREE_DEBUG=1: check device values on the host (synchronises)."""
    if draft_slots is not None and draft_slots.numel():
        lo, hi = int(draft_slots.min()), int(draft_slots.max())
        if lo < 0 or hi >= pool:
            raise argument_error("draft_slots", f"slot ids in [0, {pool})", f"range [{lo}, {hi}]")
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    mi = mask_indptr.tolist()
    T = q.shape[0]
    for b in range(len(qo) - 1):
        n = qo[b + 1] - qo[b]
        if qo[b] < 0 or n < 0 or qo[b + 1] > T or n > max_n:
            raise argument_error("qo_indptr", f"monotone values within [0, {T}] and at most max_n={max_n} apart", qo)
        L = kv[b + 1] - kv[b]
        if kv[b] < 0 or L < 0 or kv[b + 1] > kv_indices.numel():
            raise argument_error("kv_indptr", f"monotone values within [0, {kv_indices.numel()}]", kv)
        if n and (mi[b] < 0 or mi[b] + n * (L + n) > custom_mask.numel()):
            raise argument_error("custom_mask", f"request {b}'s {n}x{L + n} mask rows inside its {custom_mask.numel()} entries "
                       f"(mask_indptr[{b}]={mi[b]})", "rows past the end")
        if L:
            sl = kv_indices[kv[b] : kv[b + 1]]
            lo, hi = int(sl.min()), int(sl.max())
            if lo < 0 or hi >= pool:
                raise argument_error("kv_indices", f"slot ids in [0, {pool}) for request {b}", f"range [{lo}, {hi}]")


def _launch(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
            out, lse, workspace, sm_scale: float, max_n: int, num_splits: int, target: int = 0,
            draft_slots: torch.Tensor | None = None, plan: VerifyPlan | None = None, plan_mode: int = 0) -> None:
    lib = library.load()
    T, H = q.shape[0], q.shape[1]
    pool, kv_st = _latent_rows("kv_buffer", kv_buffer)
    a = library.KdtreeVerifyArgs()
    a.abi_version = lib.abi  # an ABI 2 library (A/B runs) reads the struct without the plan fields
    if plan is not None:
        a.plan_mode, a.plan, a.plan_bytes = plan_mode, plan.buffer.data_ptr(), plan.buffer.numel()
    a.q, a.q_stride_tok, a.q_stride_head = q.data_ptr(), q.stride(0), q.stride(1)
    if draft_slots is not None:  # the kernel reads the drafts from the pool at these slots
        a.draft_slots, a.draft_slots_is_64 = draft_slots.data_ptr(), int(draft_slots.dtype == torch.int64)
    else:
        _, k_st = _latent_rows("k_ext", k_ext)
        a.k_ext, a.k_ext_stride_tok = k_ext.data_ptr(), k_st
    a.kv, a.kv_stride_slot, a.pool_size = kv_buffer.data_ptr(), kv_st, pool
    a.qo_indptr, a.kv_indptr = qo_indptr.data_ptr(), kv_indptr.data_ptr()
    a.qo_indptr_is_64 = int(qo_indptr.dtype == torch.int64)
    a.kv_indptr_is_64 = int(kv_indptr.dtype == torch.int64)
    a.kv_indices, a.kv_indices_is_64 = kv_indices.data_ptr(), int(kv_indices.dtype == torch.int64)
    a.kv_indices_len = kv_indices.numel()
    a.mask, a.mask_indptr, a.mask_len = custom_mask.data_ptr(), mask_indptr.data_ptr(), custom_mask.numel()
    a.o, a.o_stride_tok, a.o_stride_head = out.data_ptr(), out.stride(0), out.stride(1)
    a.lse = lse.data_ptr() if lse is not None else None
    a.workspace, a.workspace_bytes = workspace.data_ptr(), workspace.numel()
    a.bs, a.num_heads, a.max_n, a.total_tokens = qo_indptr.numel() - 1, H, max_n, T
    a.num_splits, a.sm_scale, a.target = num_splits, float(sm_scale), target
    stream = torch.cuda.current_stream(q.device).cuda_stream
    rc = lib.verify_attn(a, stream)
    if rc != library.OK:
        raise RuntimeError(f"kdtree verify kernel failed (code {rc}): {lib.last_error()}")
    if debug_enabled() and not torch.cuda.is_current_stream_capturing():
        bits = lib.read_device_error(workspace.data_ptr(), stream)
        if bits:
            raise RuntimeError(f"kdtree verify kernel flagged bad device values: {library.describe_device_error(bits)}")


def _run(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out, lse,
         workspace: torch.Tensor | None, sm_scale: float, max_n: int, num_splits: int | None,
         max_prefix_len: int | None, target: int = 0, draft_slots: torch.Tensor | None = None,
         plan: VerifyPlan | None = None, make_plan: bool = False) -> None:
    """Choose the splits and the workspace (host-side, from the library), then launch.
    Shared by the eager path and the custom op's CUDA implementation."""
    lib = library.load()
    T, H = q.shape[0], q.shape[1]
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    bs = qo_indptr.numel() - 1
    plan_mode = library.PLAN_NONE
    if plan is not None:
        if plan.device != torch.device("cuda", dev):
            raise argument_error("plan", f"a VerifyPlan on {q.device}", f"one on {plan.device}")
        shape = (target, bs, H, max_n, T)
        if make_plan:
            plan_mode = library.PLAN_MAKE
        else:
            plan_mode = library.PLAN_USE
            if plan.key is None or plan.key[:5] != shape:
                got = _describe_plan_key(plan.key)
                raise argument_error("plan", f"a plan made (make_plan=True) by a call of this shape, {_describe_plan_key(shape)}",
                           f"one made for {got}")
            if num_splits is not None and num_splits != plan.key[5]:
                raise argument_error("num_splits", f"the plan's {plan.key[5]} (or None) with plan=", num_splits)
            num_splits = plan.key[5]  # the grid the plan was made for, whatever this call's hint
    if num_splits is None:
        num_splits = choose_num_splits(bs, max_n, H, _sm_count(dev), lib.block_rows(dev, target),
                                       max_prefix_len)
    need = lib.workspace_bytes(T * H, num_splits)
    if workspace is None:
        workspace = _workspaces.get(q.device, need)
    elif workspace.numel() < need:
        raise argument_error("workspace", f"a contiguous uint8 tensor of >= {need} bytes on {q.device}",
                   f"{workspace.numel()} bytes on {workspace.device}")
    if debug_enabled() and not torch.cuda.is_current_stream_capturing():
        pool, _ = _latent_rows("kv_buffer", kv_buffer)
        _debug_check_values(q, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, pool, max_n, draft_slots)
    if plan is not None and make_plan:
        plan.key = None  # until the launch below succeeds: a failed making call leaves no plan to use
    _launch(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
            out, lse, workspace, float(sm_scale), max_n, num_splits, target, draft_slots, plan, plan_mode)
    if plan is not None and make_plan:
        plan.key = (target, bs, H, max_n, T, num_splits)


@torch.library.custom_op(OP_NAME, mutates_args=("out", "lse", "workspace"), device_types="cuda")
def _verify_attention_op(
    q: torch.Tensor,
    k_ext: torch.Tensor | None,
    kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    workspace: torch.Tensor | None,
    sm_scale: float,
    max_n: int,
    num_splits: int,
    max_prefix_len: int,
    target: int,
    draft_slots: torch.Tensor | None = None,
) -> None:
    """The op torch.compile sees. ``num_splits`` 0 and ``workspace`` None: chosen at run
    time (the per-stream workspace); ``max_prefix_len`` -1: no hint; ``target`` the ABI's
    KDTREE_TARGET_* code; ``draft_slots`` (with ``k_ext`` None): the drafts' pool slots."""
    _run(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out, lse, workspace,
         sm_scale, max_n, num_splits or None, None if max_prefix_len < 0 else max_prefix_len, target, draft_slots)


@_verify_attention_op.register_fake
def _(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
      out, lse, workspace, sm_scale, max_n, num_splits, max_prefix_len, target, draft_slots=None) -> None:
    # The same host-side checks as an eager call, on fake tensors (shapes, dtypes, strides).
    check_arguments(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                    sm_scale, max_n, out, lse, require_cuda=False, draft_slots=draft_slots)
    return None


def verify_attention(
    q: torch.Tensor,
    k_ext: torch.Tensor | None,
    kv_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor,
    mask_indptr: torch.Tensor,
    sm_scale: float,
    max_n: int,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    max_prefix_len: int | None = None,
    prefix_lens_cpu: Sequence[int] | torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    target: str | None = None,
    draft_slots: torch.Tensor | None = None,
    plan: VerifyPlan | None = None,
    make_plan: bool = False,
):
    """Tree-verify MLA attention (docs/design.md section 4).

    q [T, H, 576] bf16; k_ext [T, 1, 576] (or [T, 576]) bf16, the drafts' own
    latents, or None with ``draft_slots`` [T] int64/int32: the pool slots SGLang wrote
    the drafts' latents to (``out_cache_loc``; the kernel reads them there, no gather); kv_buffer [P, 1, 576] (or [P, 576]) bf16, the paged pool;
    qo_indptr, kv_indptr int32 or int64 [bs + 1]; kv_indices int64 or int32;
    custom_mask bool or uint8, SGLang FULL_MASK; mask_indptr int64 [bs + 1];
    max_n: the most drafts any request has (a Python int).

    Returns out [T, H, 512] bf16 (and lse [T, H] fp32, natural log, with
    ``return_lse``). ``num_splits`` overrides the split-KV heuristic's grid (the
    most splits a request may take; each takes no more than its length needs,
    :func:`choose_num_splits`); ``max_prefix_len`` and ``prefix_lens_cpu`` are
    host-side hints that shrink it and enable more checks. ``workspace`` (uint8
    CUDA tensor) replaces the cached one of the current (device, stream); its first
    256 bytes must be zero when it is first used. ``target``: ``"native"`` or
    ``"sm_120"`` (what an sm_120 GPU runs, under its limits, on a GPU of compute
    capability >= 9.0); None reads ``KDTREE_TARGET``.

    ``plan`` (a :class:`VerifyPlan`) with ``make_plan=True``: compute this step's batch
    schedule into the plan (one small kernel) and run from it; with ``make_plan`` False: run
    from the plan an earlier call of the same shape and lengths made (the step's other layers).

    Under ``torch.compile`` the call is one opaque op (``kdtree::verify_attention``)
    whose fake implementation runs the same checks; the library is consulted
    only when the compiled code runs.
    """
    tcode = resolve_target(target)
    if not isinstance(make_plan, bool):
        raise argument_error("make_plan", "a bool", repr(make_plan))
    if plan is not None and not isinstance(plan, VerifyPlan):
        raise argument_error("plan", "a VerifyPlan or None", type(plan).__name__)
    if make_plan and plan is None:
        raise argument_error("plan", "a VerifyPlan to make (make_plan=True)", None)
    if prefix_lens_cpu is not None and max_prefix_len is None:
        lens = prefix_lens_cpu.tolist() if isinstance(prefix_lens_cpu, torch.Tensor) else list(prefix_lens_cpu)
        max_prefix_len = max(lens, default=0)
    shapes = check_arguments(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                             sm_scale, max_n, out, lse, prefix_lens_cpu, draft_slots=draft_slots)
    T, H = shapes.total_tokens, shapes.num_heads
    if out is None:
        out = torch.empty((T, H, V_DIM), dtype=torch.bfloat16, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= 65535):
        raise argument_error("num_splits", "an int in [1, 65535]", num_splits)
    if workspace is not None:
        _check_dtype("workspace", workspace, (torch.uint8,))
        if workspace.device != q.device or not workspace.is_contiguous():
            raise argument_error("workspace", f"a contiguous uint8 tensor on {q.device}",
                       f"{workspace.numel()} bytes on {workspace.device}")
    if torch.compiler.is_compiling():  # one opaque op in the compiled graph
        if plan is not None:
            raise argument_error("plan", "None under torch.compile (the op is opaque there; plan in eager or "
                       "graph-captured code)", repr(plan))
        torch.ops.kdtree.verify_attention(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                          mask_indptr, out, lse, workspace, float(sm_scale), max_n,
                                          num_splits or 0, -1 if max_prefix_len is None else int(max_prefix_len),
                                          tcode, draft_slots)
    else:  # eager and CUDA-graph capture: skip the dispatcher's Python overhead
        _run(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out, lse,
             workspace, sm_scale, max_n, num_splits, max_prefix_len, tcode, draft_slots, plan, make_plan)
    return (out, lse) if return_lse else out
