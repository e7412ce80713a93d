"""The arguments of one verify call as one typed object, and the small checks it passes.

:class:`VerifyArgs` holds a call's tensors and scalars by name, as
:func:`kdtree_engine.kernel.op.verify_attention` takes them. One is built per call: by
``verify_attention``, by the implementations of the ``kdtree::verify_attention`` custom op
(from the flat signature ``torch.library`` needs), or by the SGLang plugin's ``prepare``
directly from SGLang's metadata. :func:`kdtree_engine.kernel.op.check_arguments` runs the
checks below on it once, in a fixed order, and the launch fills the C ABI's argument
struct from it.

Each ``check_*`` function checks one argument or one relation between arguments and
raises :class:`~kdtree_engine.kernel.errors.VerifyArgumentError` naming the argument. They
read host-side facts only (types, dtypes, shapes, strides, devices, addresses), never
device memory, so they cost no synchronisation, run under CUDA-graph capture, and run on
the fake tensors of ``torch.compile`` and ``torch.library.opcheck`` (which have no
addresses: the address checks skip them; the library checks alignment again at every
launch).
:func:`check_values` (``KDTREE_DEBUG=1``) is the exception: it reads the indptrs and slot
ids on the host.

This is the per-call path of a serving engine (one call per layer of every verify step), so
the checks read each tensor attribute once where they can and avoid ``is_fake`` (over a
microsecond a call) on plain tensors, which are never fake.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import is_fake

from kdtree_engine.kernel.errors import argument_error

if TYPE_CHECKING:
    from kdtree_engine.kernel.plan import VerifyPlan

#: the latent width of a query and a key (512 nope + 64 rope), the C ABI's KDTREE_HEAD_DIM
HEAD_DIM = 576
#: the output width (the first 512 values of a latent are V), KDTREE_V_DIM
V_DIM = 512
#: query heads the kernel takes, KDTREE_MAX_HEADS
MAX_HEADS = 128
#: drafts per request the kernel takes, KDTREE_MAX_DRAFTS
MAX_DRAFTS = 128
#: the grid's split count the ABI takes (an int32 the launch keeps within a CUDA grid dimension)
MAX_NUM_SPLITS = 65535

BF16 = (torch.bfloat16,)
INDPTR_DTYPES = (torch.int32, torch.int64)
SLOT_DTYPES = (torch.int64, torch.int32)
MASK_DTYPES = (torch.bool, torch.uint8)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class VerifyArgs:
    """One verify call's arguments, by name (docs/design.md section 4 gives the layout).

    The tensors are :func:`~kdtree_engine.kernel.op.verify_attention`'s, unchanged.
    ``out`` (and ``lse``) is what the kernel writes: ``verify_attention`` allocates it when
    its caller passes none; :func:`~kdtree_engine.kernel.op.verify` needs it given.
    ``target`` is the ABI's KDTREE_TARGET_* code (:func:`kdtree_engine.kernel.library.resolve_target`
    makes it from ``"native"``, ``"sm_120"`` or ``KDTREE_TARGET``). ``num_splits``,
    ``max_prefix_len`` and ``prefix_lens_cpu`` are host-side hints (None: none);
    ``workspace`` None takes the cached one of the call's (device, stream).

    Frozen: the checks pass on the object the launch reads. Equality is identity (two
    calls' tensors are not compared) and the repr shows shapes, not values.
    """

    q: torch.Tensor
    k_ext: torch.Tensor | None
    kv_buffer: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    custom_mask: torch.Tensor
    mask_indptr: torch.Tensor
    sm_scale: float
    max_n: int
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    num_splits: int | None = None
    max_prefix_len: int | None = None
    prefix_lens_cpu: Sequence[int] | torch.Tensor | None = None
    workspace: torch.Tensor | None = None
    target: int = 0
    draft_slots: torch.Tensor | None = None
    plan: VerifyPlan | None = None
    make_plan: bool = False

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}@{v.device}"
            if v is not None:
                parts.append(f"{f.name}={v}")
        return f"VerifyArgs({', '.join(parts)})"


@dataclass(frozen=True, slots=True)
class Shapes:
    """What the checks learned about a call (host-side facts), for the launch."""

    bs: int
    total_tokens: int
    num_heads: int
    max_n: int
    pool_size: int
    #: the longest prefix, from ``max_prefix_len`` or ``prefix_lens_cpu`` (None: no hint)
    max_prefix_len: int | None = None


# --- helpers of the checks ---------------------------------------------------------------


def check_dtype(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise argument_error(name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        raise argument_error(name, "dtype " + " or ".join(str(d) for d in dtypes), t.dtype)


def latent_rows(name: str, t: torch.Tensor) -> tuple[int, int]:
    """[R, 1, 576] or [R, 576] -> (R, row stride in elements)."""
    shape = t.shape
    if (len(shape) == 3 and shape[1] == 1 and shape[2] == HEAD_DIM) or (len(shape) == 2 and shape[1] == HEAD_DIM):
        return shape[0], t.stride(0)
    raise argument_error(name, f"shape [rows, 1, {HEAD_DIM}] or [rows, {HEAD_DIM}]", list(shape))


def has_memory(t: torch.Tensor) -> bool:
    """Does ``t`` have real memory (an address)? Fake tensors (torch.compile's tracing,
    ``torch.library.opcheck``) and meta tensors have none: address checks are skipped
    for them (the library checks alignment at the launch). A plain ``torch.Tensor`` is
    never fake (fake ones are a subclass), so only subclasses pay for ``is_fake``."""
    if torch.compiler.is_compiling() or t.is_meta:  # dynamo traces fake tensors
        return False
    return type(t) is torch.Tensor or not is_fake(t)


def check_rows(name: str, t: torch.Tensor, row_strides: Sequence[int]) -> None:
    """Last dim contiguous, 16-byte aligned rows (the kernel moves 16 bytes at a time)."""
    if t.stride(-1) != 1:
        raise argument_error(name, "a contiguous last dimension (stride 1)", f"stride {t.stride(-1)}")
    if t.numel() and has_memory(t) and t.data_ptr() % 16:
        raise argument_error(name, "a 16-byte aligned data pointer", f"address {t.data_ptr():#x}")
    for s in row_strides:
        if s % 8:
            raise argument_error(name, "row strides that are multiples of 8 elements (16 bytes)", list(t.stride()))


def check_index(name: str, t: object, dtypes: tuple[torch.dtype, ...], length: int | None) -> None:
    """A 1-D contiguous integer (or mask) tensor, of ``length`` elements when given."""
    check_dtype(name, t, dtypes)
    if t.dim() != 1:
        raise argument_error(name, "a 1-D tensor", f"shape {list(t.shape)}")
    if length is not None and t.numel() != length:
        raise argument_error(name, f"{length} elements (batch size + 1)", t.numel())
    if not t.is_contiguous():
        raise argument_error(name, "a contiguous tensor", f"strides {list(t.stride())}")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte address of a contiguous tensor."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _dense_range(t: torch.Tensor, device: torch.device) -> tuple[int, int] | None:
    """The byte range of ``t`` when it is a non-empty contiguous tensor with an address on
    ``device``, else None: nothing to compare. Two live tensors of one device share an
    address only where they share memory, so their byte ranges decide whether they
    overlap. Strided views may interleave without sharing an element, so only a definite
    overlap of two contiguous tensors is reported; fake and meta tensors have no
    addresses to compare."""
    if t.numel() == 0 or t.device != device or not t.is_contiguous() or not has_memory(t):
        return None
    return _byte_range(t)


def _prefix_ints(hint: Sequence[int] | torch.Tensor) -> list[int]:
    """``prefix_lens_cpu`` as Python ints (an integer tensor's ``tolist`` already gives them)."""
    if isinstance(hint, torch.Tensor):
        values = hint.tolist()
        return [int(x) for x in values] if hint.is_floating_point() else values
    return [int(x) for x in hint]


# --- the checks, in the order op.check_arguments runs them -------------------------------------


def check_q(q: object) -> tuple[int, int]:
    """q [T, H, 576] bf16, 1..128 heads, 16-byte rows -> (T, H)."""
    check_dtype("q", q, BF16)
    shape = q.shape
    if len(shape) != 3 or shape[2] != HEAD_DIM:
        raise argument_error("q", f"shape [tokens, heads, {HEAD_DIM}]", list(shape))
    T, H = shape[0], shape[1]
    if not 1 <= H <= MAX_HEADS:
        raise argument_error("q", f"1..{MAX_HEADS} heads (q.shape[1])", H)
    check_rows("q", q, (q.stride(0), q.stride(1)))
    return T, H


def check_drafts(a: VerifyArgs, T: int) -> None:
    """The drafts' latents: ``k_ext`` [T, 1, 576] bf16, or ``draft_slots`` [T] (their pool
    slots) with ``k_ext`` None; one of the two."""
    if a.draft_slots is not None:
        check_index("draft_slots", a.draft_slots, SLOT_DTYPES, None)
        if a.draft_slots.numel() != T:
            raise argument_error("draft_slots", f"{T} slot ids (one per draft token, as q.shape[0])",
                                 a.draft_slots.numel())
        if a.k_ext is not None:
            raise argument_error("k_ext", "None when draft_slots is given (the drafts come from one of them)",
                                 "a tensor")
        return
    k = a.k_ext
    if k is None:
        raise argument_error("k_ext", "the drafts' latents [T, 1, 576] (or draft_slots: their slots in kv_buffer)",
                             None)
    check_dtype("k_ext", k, BF16)
    rows, stride = latent_rows("k_ext", k)
    if rows != T:
        raise argument_error("k_ext", f"{T} rows (one latent per draft token, as q.shape[0])", rows)
    check_rows("k_ext", k, (stride,))


def check_pool(kv_buffer: object) -> int:
    """The KV pool [P, 1, 576] bf16 with at least the padding slot -> P."""
    check_dtype("kv_buffer", kv_buffer, BF16)
    pool, stride = latent_rows("kv_buffer", kv_buffer)
    if pool < 1:
        raise argument_error("kv_buffer", "at least one slot (slot 0 is the padding slot)", pool)
    check_rows("kv_buffer", kv_buffer, (stride,))
    return pool


def check_indptrs(a: VerifyArgs) -> int:
    """The batch's index tensors: qo_indptr, kv_indptr, mask_indptr of bs + 1 entries,
    kv_indices and custom_mask 1-D -> bs."""
    qo = a.qo_indptr
    check_dtype("qo_indptr", qo, INDPTR_DTYPES)
    n = qo.numel()
    if qo.dim() != 1 or n < 1:
        raise argument_error("qo_indptr", "a 1-D tensor of batch size + 1 >= 1 elements", list(qo.shape))
    # The batch size comes from qo_indptr; when kv_indptr and mask_indptr agree on another
    # length, qo_indptr is the odd one out and the error names it.
    others = {t.numel() for t in (a.kv_indptr, a.mask_indptr) if isinstance(t, torch.Tensor) and t.dim() == 1}
    if len(others) == 1 and n not in others:
        raise argument_error("qo_indptr", f"{others.pop()} elements (batch size + 1, as kv_indptr and "
                             "mask_indptr have)", n)
    if not qo.is_contiguous():
        raise argument_error("qo_indptr", "a contiguous tensor", f"strides {list(qo.stride())}")
    check_index("kv_indptr", a.kv_indptr, INDPTR_DTYPES, n)
    check_index("kv_indices", a.kv_indices, SLOT_DTYPES, None)
    check_index("custom_mask", a.custom_mask, MASK_DTYPES, None)
    check_index("mask_indptr", a.mask_indptr, (torch.int64,), n)
    return n - 1


def check_max_n(max_n: object, T: int, bs: int) -> None:
    """max_n: a Python int in 0..128, at least the drafts per request on average."""
    if isinstance(max_n, bool) or not isinstance(max_n, int):
        raise argument_error("max_n", "a Python int (drafts per request, SGLang's max_extend_len)",
                             type(max_n).__name__)
    if not 0 <= max_n <= MAX_DRAFTS:
        raise argument_error("max_n", f"0..{MAX_DRAFTS} drafts per request", max_n)
    if T > bs * max_n:
        raise argument_error("max_n", f"at least q.shape[0] / batch = {T}/{bs} drafts per request", max_n)


def check_sm_scale(sm_scale: object) -> None:
    """The softmax scale: a positive finite number (not a bool)."""
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not math.isfinite(sm_scale) \
            or sm_scale <= 0:
        raise argument_error("sm_scale", "a positive finite float (the softmax scale)", sm_scale)


def check_prefix_hint(a: VerifyArgs, T: int, bs: int) -> int | None:
    """``prefix_lens_cpu`` (host-side prefix lengths): one non-negative length per request,
    no more than kv_indices holds, and, when every request has max_n drafts, no more than
    the mask holds -> the longest prefix (``max_prefix_len`` wins when given), or None."""
    hint = a.prefix_lens_cpu
    if hint is None:
        return a.max_prefix_len
    lens = _prefix_ints(hint)
    if len(lens) != bs:
        raise argument_error("prefix_lens_cpu", f"{bs} prefix lengths (one per request)", len(lens))
    if lens and min(lens) < 0:
        raise argument_error("prefix_lens_cpu", "non-negative prefix lengths", lens)
    total = sum(lens)
    if a.kv_indices.numel() < total:
        raise argument_error("kv_indices", f">= {total} slot ids (the sum of prefix lengths)", a.kv_indices.numel())
    n = a.max_n
    if T == bs * n:  # every request has exactly max_n drafts: the mask length is known
        need = n * total + bs * n * n  # sum over requests of n x (prefix + n)
        if a.custom_mask.numel() < need:
            raise argument_error("custom_mask", f">= {need} entries (sum over requests of N x (prefix + N), N = {n})",
                                 a.custom_mask.numel())
    return a.max_prefix_len if a.max_prefix_len is not None else max(lens, default=0)


def check_out(a: VerifyArgs, T: int, H: int) -> None:
    """out (when given) [T, H, 512] bf16, 16-byte rows, sharing no memory with the inputs."""
    out = a.out
    if out is None:
        return
    check_dtype("out", out, BF16)
    if out.shape != (T, H, V_DIM):
        raise argument_error("out", f"shape [{T}, {H}, {V_DIM}]", list(out.shape))
    check_rows("out", out, (out.stride(0), out.stride(1)))
    mine = _dense_range(out, out.device)
    if mine is None:
        return
    for name, t in (("q", a.q), ("k_ext", a.k_ext), ("kv_buffer", a.kv_buffer)):
        theirs = None if t is None else _dense_range(t, out.device)
        if theirs is not None and mine[0] < theirs[1] and theirs[0] < mine[1]:
            raise argument_error("out", f"memory that does not overlap '{name}'", "an overlapping view")


def check_lse(lse: object, T: int, H: int) -> None:
    """lse (when given) [T, H] fp32, contiguous."""
    if lse is None:
        return
    check_dtype("lse", lse, (torch.float32,))
    if lse.shape != (T, H) or not lse.is_contiguous():
        raise argument_error("lse", f"a contiguous tensor of shape [{T}, {H}]",
                             f"{list(lse.shape)} strides {list(lse.stride())}")


def check_devices(a: VerifyArgs) -> None:
    """q on a CUDA device and every other tensor on that one."""
    q = a.q
    if not q.is_cuda:
        raise argument_error("q", "a CUDA tensor", q.device)
    dev = q.device
    drafts = ("k_ext", a.k_ext) if a.k_ext is not None else ("draft_slots", a.draft_slots)
    for name, t in (drafts, ("kv_buffer", a.kv_buffer), ("qo_indptr", a.qo_indptr), ("kv_indptr", a.kv_indptr),
                    ("kv_indices", a.kv_indices), ("custom_mask", a.custom_mask), ("mask_indptr", a.mask_indptr),
                    ("out", a.out), ("lse", a.lse)):
        if t is not None and t.device != dev:
            raise argument_error(name, f"a tensor on {dev} (where q is)", t.device)


def check_num_splits(num_splits: object) -> None:
    """The grid's split count (a hint; None: chosen) in [1, 65535]."""
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_NUM_SPLITS):
        raise argument_error("num_splits", f"an int in [1, {MAX_NUM_SPLITS}]", num_splits)


def check_workspace(a: VerifyArgs) -> None:
    """workspace (when given): a contiguous uint8 tensor on q's device (its size is checked
    at the launch, against the split count chosen there)."""
    ws = a.workspace
    if ws is None:
        return
    check_dtype("workspace", ws, (torch.uint8,))
    if ws.device != a.q.device or not ws.is_contiguous():
        raise argument_error("workspace", f"a contiguous uint8 tensor on {a.q.device}",
                             f"{ws.numel()} bytes on {ws.device}")


# --- KDTREE_DEBUG=1: the device values, on the host ----------------------------------------------


def _check_slot_range(name: str, ids: torch.Tensor, pool: int, where: str = "") -> None:
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= pool:
            raise argument_error(name, f"slot ids in [0, {pool}){where}", f"range [{lo}, {hi}]")


def _check_request(a: VerifyArgs, s: Shapes, b: int, qo: list[int], kv: list[int], mi: list[int]) -> None:
    """Request b's drafts, prefix, mask rows and slot ids (the values the device flags)."""
    T, max_n = s.total_tokens, s.max_n
    n = qo[b + 1] - qo[b]
    if qo[b] < 0 or n < 0 or qo[b + 1] > T or n > max_n:
        raise argument_error("qo_indptr", f"monotone values within [0, {T}] and at most max_n={max_n} apart", qo)
    L = kv[b + 1] - kv[b]
    slots = a.kv_indices.numel()
    if kv[b] < 0 or L < 0 or kv[b + 1] > slots:
        raise argument_error("kv_indptr", f"monotone values within [0, {slots}]", kv)
    entries = a.custom_mask.numel()
    if n and (mi[b] < 0 or mi[b] + n * (L + n) > entries):
        raise argument_error("custom_mask", f"request {b}'s {n}x{L + n} mask rows inside its {entries} entries "
                             f"(mask_indptr[{b}]={mi[b]})", "rows past the end")
    if L:
        _check_slot_range("kv_indices", a.kv_indices[kv[b] : kv[b + 1]], s.pool_size, f" for request {b}")


def check_values(a: VerifyArgs, s: Shapes) -> None:
    """KDTREE_DEBUG=1: the device values the kernel would flag in its error word (slot ids,
    indptr contents, mask extents), read and checked on the host (synchronises)."""
    if a.draft_slots is not None:
        _check_slot_range("draft_slots", a.draft_slots, s.pool_size)
    qo, kv, mi = a.qo_indptr.tolist(), a.kv_indptr.tolist(), a.mask_indptr.tolist()
    for b in range(s.bs):
        _check_request(a, s, b, qo, kv, mi)
