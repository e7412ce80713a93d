"""The verify-attention op: argument checks, workspace, launch, torch custom op.

Public entry point: :func:`verify_attention`. Its arguments become one
:class:`~kdtree_engine.kernel.args.VerifyArgs`, built once per call; :func:`check_arguments`
runs every check that needs no device read (dtype, shape, device, strides, alignment,
limits, lengths; the small ``check_*`` functions of :mod:`kdtree_engine.kernel.args`) on it
once and raises :class:`VerifyArgumentError` naming the argument before anything is
launched; the launch fills the C ABI's argument struct from it and calls the kernel library
on ``torch.cuda.current_stream()``. No host synchronisation and no host read of tensor
values happen on this path, so the call can be captured in a CUDA graph. A caller that
builds the object itself (the SGLang plugin, from SGLang's metadata) runs it with
:func:`verify`.

Slot ids, indptr contents and mask extents live on the device. The kernel
never reads outside the tensors it is given; it records violations in an
error word. With ``KDTREE_DEBUG=1`` the op also checks those values on the host
before the launch and reads the error word after it (both synchronise), and
raises on any violation.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence

import torch

from kdtree_engine.kernel import library
from kdtree_engine.kernel.args import (
    HEAD_DIM,
    MAX_DRAFTS,
    MAX_HEADS,
    V_DIM,
    Shapes,
    VerifyArgs,
    check_devices,
    check_drafts,
    check_indptrs,
    check_lse,
    check_max_n,
    check_num_splits,
    check_out,
    check_pool,
    check_prefix_hint,
    check_q,
    check_sm_scale,
    check_values,
    check_workspace,
)
from kdtree_engine.kernel.errors import VerifyArgumentError, argument_error
from kdtree_engine.kernel.library import TARGETS, resolve_target
from kdtree_engine.kernel.plan import VerifyPlan, describe_plan_key

__all__ = ["HEAD_DIM", "MAX_DRAFTS", "MAX_HEADS", "TARGETS", "V_DIM", "Shapes", "VerifyArgs",
           "VerifyArgumentError", "VerifyPlan", "check_arguments", "resolve_target", "verify",
           "verify_attention"]

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


def check_plan_args(a: VerifyArgs) -> None:
    """``make_plan`` a bool, ``plan`` a :class:`VerifyPlan` or None, and one to make when
    ``make_plan`` is set. (Whether the plan fits the call is checked at the launch: its
    shape is the host's record of the call that made it.)"""
    if not isinstance(a.make_plan, bool):
        raise argument_error("make_plan", "a bool", repr(a.make_plan))
    if a.plan is not None and not isinstance(a.plan, VerifyPlan):
        raise argument_error("plan", "a VerifyPlan or None", type(a.plan).__name__)
    if a.make_plan and a.plan is None:
        raise argument_error("plan", "a VerifyPlan to make (make_plan=True)", None)


def check_arguments(a: VerifyArgs, *, require_cuda: bool = True) -> Shapes:
    """Every check that needs no device read, in a fixed order (the first failing one
    raises :class:`VerifyArgumentError` naming its argument); what they learned.
    ``require_cuda`` False leaves out the device check (fake and meta tensors, CPU tests)."""
    check_plan_args(a)
    T, H = check_q(a.q)
    check_drafts(a, T)
    pool = check_pool(a.kv_buffer)
    bs = check_indptrs(a)
    check_max_n(a.max_n, T, bs)
    check_sm_scale(a.sm_scale)
    max_prefix_len = check_prefix_hint(a, T, bs)
    check_out(a, T, H)
    check_lse(a.lse, T, H)
    if require_cuda:
        check_devices(a)
    check_num_splits(a.num_splits)
    check_workspace(a)
    return Shapes(bs, T, H, a.max_n, pool, max_prefix_len)


def choose_num_splits(
    bs: int, max_n: int, num_heads: int, sm_count: int, block_rows: int, max_prefix_len: int | None = None,
    max_splits: int = 256,
) -> int:
    """The grid's split count: the most splits any request of the call may take.

    One CTA runs per SM (its shared memory is ~156 KB), so a call takes
    ceil(ctas * splits / sm_count) waves: 17 splits of 8 row tiles (136 CTAs on
    132 SMs) would take two waves where 16 take one. So: as many splits as fit
    in one wave, none when the batch alone fills the GPU.

    The device trims this per request (csrc/common.cuh ``split_plan``): each request
    takes ceil((prefix + N) / 128) splits at most, every one non-empty, from the
    lengths it reads; the CTAs of the splits it does not need exit at once and a
    request of one split skips the combine. So under CUDA-graph capture, where no
    hint exists and the grid takes the GPU-filling count, a short replayed prefix
    costs no empty splits. ``max_prefix_len`` (a host-side hint, e.g. SGLang's
    seq_lens_cpu) applies the same rule to the longest request on the host, which
    only shrinks the grid.
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


def _plan_mode(a: VerifyArgs, s: Shapes, device_index: int) -> tuple[int, int | None]:
    """(the ABI's plan_mode, the split count) of a call: a plan must be on the call's
    device, and one to read must have been made by a call of this shape, whose split count
    this call then takes (None: chosen at the launch)."""
    plan = a.plan
    if plan is None:
        return library.PLAN_NONE, a.num_splits
    if plan.device != torch.device("cuda", device_index):
        raise argument_error("plan", f"a VerifyPlan on {a.q.device}", f"one on {plan.device}")
    if a.make_plan:
        return library.PLAN_MAKE, a.num_splits
    shape = (a.target, s.bs, s.num_heads, s.max_n, s.total_tokens)
    if plan.key is None or plan.key[:5] != shape:
        raise argument_error("plan", f"a plan made (make_plan=True) by a call of this shape, "
                             f"{describe_plan_key(shape)}", f"one made for {describe_plan_key(plan.key)}")
    if a.num_splits is not None and a.num_splits != plan.key[5]:
        raise argument_error("num_splits", f"the plan's {plan.key[5]} (or None) with plan=", a.num_splits)
    return library.PLAN_USE, plan.key[5]  # the grid the plan was made for


def _abi_args(a: VerifyArgs, s: Shapes, workspace: torch.Tensor, num_splits: int, plan_mode: int,
              abi: int) -> library.KdtreeVerifyArgs:
    """The C ABI's KdtreeVerifyArgs (csrc/kdtree_verify.h) of a checked call: the one place
    that turns the call's tensors into addresses, strides and flags."""
    q, out, kv = a.q, a.out, a.kv_buffer
    c = library.KdtreeVerifyArgs()
    c.abi_version = abi  # an ABI 2 library (A/B runs against older builds) reads the struct without the plan
    c.q, c.q_stride_tok, c.q_stride_head = q.data_ptr(), q.stride(0), q.stride(1)
    if a.draft_slots is not None:  # the kernel reads the drafts from the pool at these slots
        c.draft_slots, c.draft_slots_is_64 = a.draft_slots.data_ptr(), int(a.draft_slots.dtype == torch.int64)
    else:  # [T, 1, 576] or [T, 576]: a row is stride(0) apart in both
        c.k_ext, c.k_ext_stride_tok = a.k_ext.data_ptr(), a.k_ext.stride(0)
    c.kv, c.kv_stride_slot, c.pool_size = kv.data_ptr(), kv.stride(0), s.pool_size
    c.qo_indptr, c.qo_indptr_is_64 = a.qo_indptr.data_ptr(), int(a.qo_indptr.dtype == torch.int64)
    c.kv_indptr, c.kv_indptr_is_64 = a.kv_indptr.data_ptr(), int(a.kv_indptr.dtype == torch.int64)
    c.kv_indices, c.kv_indices_is_64 = a.kv_indices.data_ptr(), int(a.kv_indices.dtype == torch.int64)
    c.kv_indices_len = a.kv_indices.numel()
    c.mask, c.mask_len, c.mask_indptr = a.custom_mask.data_ptr(), a.custom_mask.numel(), a.mask_indptr.data_ptr()
    c.o, c.o_stride_tok, c.o_stride_head = out.data_ptr(), out.stride(0), out.stride(1)
    c.lse = a.lse.data_ptr() if a.lse is not None else None
    c.workspace, c.workspace_bytes = workspace.data_ptr(), workspace.numel()
    c.bs, c.num_heads, c.max_n, c.total_tokens = s.bs, s.num_heads, s.max_n, s.total_tokens
    c.num_splits, c.sm_scale, c.target = num_splits, float(a.sm_scale), a.target
    if a.plan is not None:
        c.plan_mode, c.plan, c.plan_bytes = plan_mode, a.plan.buffer.data_ptr(), a.plan.buffer.numel()
    return c


def _launch(a: VerifyArgs, s: Shapes, workspace: torch.Tensor, num_splits: int, plan_mode: int,
            debug: bool) -> None:
    """Fill the ABI struct and launch on the current stream; with ``debug`` (KDTREE_DEBUG=1
    outside graph capture) read the workspace's error word after it (synchronises)."""
    lib = library.load()
    stream = torch.cuda.current_stream(a.q.device).cuda_stream
    rc = lib.verify_attn(_abi_args(a, s, workspace, num_splits, plan_mode, lib.abi), stream)
    if rc != library.OK:
        raise RuntimeError(f"kdtree verify kernel failed (code {rc}): {lib.last_error()}")
    if debug:
        bits = lib.read_device_error(workspace.data_ptr(), stream)
        if bits:
            raise RuntimeError(f"kdtree verify kernel flagged bad device values: {library.describe_device_error(bits)}")


def _run(a: VerifyArgs, s: Shapes) -> None:
    """Choose the plan mode, the splits and the workspace (host-side, from the library),
    then launch. Shared by the eager path and the custom op's CUDA implementation."""
    lib = library.load()
    q = a.q
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    plan_mode, num_splits = _plan_mode(a, s, dev)
    if num_splits is None:
        num_splits = choose_num_splits(s.bs, s.max_n, s.num_heads, _sm_count(dev), lib.block_rows(dev, a.target),
                                       s.max_prefix_len)
    need = lib.workspace_bytes(s.total_tokens * s.num_heads, num_splits)
    workspace = a.workspace
    if workspace is None:
        workspace = _workspaces.get(q.device, need)
    elif workspace.numel() < need:
        raise argument_error("workspace", f"a contiguous uint8 tensor of >= {need} bytes on {q.device}",
                             f"{workspace.numel()} bytes on {workspace.device}")
    debug = debug_enabled() and not torch.cuda.is_current_stream_capturing()  # both synchronise
    if debug:
        check_values(a, s)
    making = plan_mode == library.PLAN_MAKE
    if making:
        a.plan.key = None  # until the launch below succeeds: a failed making call leaves no plan to use
    _launch(a, s, workspace, num_splits, plan_mode, debug)
    if making:
        a.plan.key = (a.target, s.bs, s.num_heads, s.max_n, s.total_tokens, num_splits)


def verify(a: VerifyArgs) -> None:
    """Check ``a`` once and run the kernel into ``a.out`` (and ``a.lse``): what
    :func:`verify_attention` does after building the arguments, for a caller that builds
    them itself (the SGLang plugin). ``a.out`` must be given. Under ``torch.compile`` the
    call is the opaque ``kdtree::verify_attention`` op (its fake runs these checks again)."""
    s = check_arguments(a)
    if a.out is None:
        raise argument_error("out", f"an output tensor [{s.total_tokens}, {s.num_heads}, {V_DIM}] bf16 "
                             "(verify_attention allocates one; verify writes into the caller's)", None)
    if not torch.compiler.is_compiling():  # eager and CUDA-graph capture: no dispatcher overhead
        _run(a, s)
        return
    if a.plan is not None:
        raise argument_error("plan", "None under torch.compile (the op is opaque there; plan in eager or "
                             "graph-captured code)", repr(a.plan))
    torch.ops.kdtree.verify_attention(
        a.q, a.k_ext, a.kv_buffer, a.qo_indptr, a.kv_indptr, a.kv_indices, a.custom_mask, a.mask_indptr,
        a.out, a.lse, a.workspace, float(a.sm_scale), a.max_n, a.num_splits or 0,
        -1 if s.max_prefix_len is None else int(s.max_prefix_len), a.target, a.draft_slots)


def _op_args(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out, lse,
             workspace, sm_scale, max_n, num_splits, max_prefix_len, target, draft_slots) -> VerifyArgs:
    """The custom op's flat arguments (the signature torch.library needs) as the call's
    object: ``num_splits`` 0 and ``max_prefix_len`` -1 mean none."""
    return VerifyArgs(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
                      max_n, out=out, lse=lse, workspace=workspace, num_splits=num_splits or None,
                      max_prefix_len=None if max_prefix_len < 0 else max_prefix_len, target=target,
                      draft_slots=draft_slots)


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
    KDTREE_TARGET_* code; ``draft_slots`` (with ``k_ext`` None): the drafts' pool slots.

    The compiled code runs this without the checks: the call's arguments were checked once,
    when it was traced (by verify_attention on the fake tensors, devices included, and by the
    fake below), and the library checks alignment, strides and sizes again at the launch."""
    a = _op_args(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out, lse,
                 workspace, sm_scale, max_n, num_splits, max_prefix_len, target, draft_slots)
    _run(a, Shapes(bs=qo_indptr.numel() - 1, total_tokens=q.shape[0], num_heads=q.shape[1], max_n=max_n,
                   pool_size=kv_buffer.shape[0], max_prefix_len=a.max_prefix_len))


@_verify_attention_op.register_fake
def _(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
      out, lse, workspace, sm_scale, max_n, num_splits, max_prefix_len, target, draft_slots=None) -> None:
    # The same host-side checks as an eager call, on fake tensors (shapes, dtypes, strides).
    check_arguments(_op_args(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, out,
                             lse, workspace, sm_scale, max_n, num_splits, max_prefix_len, target, draft_slots),
                    require_cuda=False)
    return None


def _new_outputs(q: object, out: torch.Tensor | None, lse: torch.Tensor | None,
                 return_lse: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``out`` [T, H, 512] bf16 (and ``lse`` [T, H] fp32 with ``return_lse``) where the
    caller gave none, shaped from q. A q of another form gets none: the checks refuse it."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        return out, lse
    T, H = q.shape[0], q.shape[1]
    if out is None:
        out = torch.empty((T, H, V_DIM), dtype=torch.bfloat16, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((T, H), dtype=torch.float32, device=q.device)
    return out, lse


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

    The arguments become one :class:`VerifyArgs`, checked once by :func:`check_arguments`
    and read by the launch (:func:`verify` runs one built elsewhere).
    """
    tcode = resolve_target(target)
    if out is None or (lse is None and return_lse):
        out, lse = _new_outputs(q, out, lse, return_lse)
    verify(VerifyArgs(q, k_ext, kv_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, sm_scale,
                      max_n, out=out, lse=lse, num_splits=num_splits, max_prefix_len=max_prefix_len,
                      prefix_lens_cpu=prefix_lens_cpu, workspace=workspace, target=tcode,
                      draft_slots=draft_slots, plan=plan, make_plan=make_plan))
    return (out, lse) if return_lse else out
