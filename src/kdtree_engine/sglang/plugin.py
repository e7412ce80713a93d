"""SGLang plugin: route the TARGET_VERIFY step of MLA models to the owned kernel.

SGLang calls :func:`load` (entry point ``kdtree_verify`` in the group
``sglang.srt.plugins``) through ``sglang.srt.plugins.load_plugins()`` in the
launcher and in every scheduler / tensor-parallel worker process. With
``KDTREE_VERIFY=on`` it registers an AROUND hook on
``TritonAttnBackend.forward_extend`` with SGLang's ``HookRegistry``; with
``off`` or unset it registers nothing; any other value ends the process at plugin
load (:class:`KdtreeConfigExit`, a ``SystemExit``: SGLang's loader catches
``Exception`` from plugins and would keep serving), naming the variable and value.
Before hooking, :func:`kdtree_engine.sglang.drift.check` confirms that every
attribute and method of SGLang's classes the hooked path reads exists; if one is
missing nothing is hooked and the error names it.

The hook (:func:`verify_hook`) takes a call only when every predicate of
:mod:`kdtree_engine.sglang.fallback` accepts it; it then saves the draft KV to
the pool with SGLang's own code (the release's ``KVWriteLoc`` +
``TritonAttnBackend._set_kv_buffer``, as the original does) and runs
:func:`kdtree_engine.kernel.op.verify_attention` on SGLang's own metadata,
writing into the output tensor SGLang would return (``[tokens, heads * 512]``).
The first hooked call of a verify step (a new ``forward_metadata``: SGLang builds one per step)
makes the step plan (:class:`kdtree_engine.kernel.op.VerifyPlan`, one buffer per backend) and
the step's other layers read it, as FlashMLA's calls read its once-per-step metadata; under
CUDA-graph capture the first layer's plan kernel is captured with it, so every replay plans
from the lengths it replays.
Every other call, and every call the kernel rejects, goes to SGLang's original
method. Every step of the hooked path that touches SGLang's objects runs inside
that fallback, the KV write included: a KV write that fails sends the call to
SGLang's own method with ``save_kv_cache`` as given (so it writes the KV once).
What is active, and each *kind* of fallback (a fixed sentence, no per-batch
numbers), is logged once per process with the tensor-parallel rank; counters are
in :func:`status`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from kdtree_engine.sglang import fallback
from kdtree_engine.sglang.fallback import VerifyCall

logger = logging.getLogger("kdtree_engine.sglang")

#: The environment switch.
ENV = "KDTREE_VERIFY"
#: What the hook wraps (SGLang's HookRegistry target path).
TARGET_MODULE = "sglang.srt.layers.attention.triton_backend"
TARGET_CLASS = "TritonAttnBackend"
TARGET_METHOD = "forward_extend"
TARGET = f"{TARGET_MODULE}.{TARGET_CLASS}.{TARGET_METHOD}"
#: The SGLang releases the hook is written for (both ends checked: ``nox -s drift``).
SUPPORTED = fallback.SUPPORTED

_E = inspect.Parameter.empty
#: forward_extend's parameters in every supported release (0.5.17 and 0.5.23 alike): (name, default).
EXPECTED_PARAMS: tuple[tuple[str, Any], ...] = (
    ("self", _E),
    ("q", _E),
    ("k", _E),
    ("v", _E),
    ("layer", _E),
    ("forward_batch", _E),
    ("save_kv_cache", True),
    ("sinks", None),
    ("score_mod", None),
    ("aux_tensors", None),
)
_ARG_NAMES = tuple(n for n, _ in EXPECTED_PARAMS[1:])
_DEFAULTS = {n: d for n, d in EXPECTED_PARAMS[1:] if d is not _E}


class KdtreeConfigError(ValueError):
    """A user configuration error (a bad ``KDTREE_VERIFY`` value)."""


class KdtreeConfigExit(SystemExit):
    """Raised by :func:`load` on a configuration error: a ``SystemExit``, which SGLang's
    ``load_plugins`` (it catches ``Exception``) lets through, so the launch stops with
    exit status 1 and this message on stderr instead of serving without the plugin."""


def read_switch(environ: Mapping[str, str] | None = None) -> bool:
    """``KDTREE_VERIFY``: ``on`` -> True; ``off`` or unset/empty -> False; else raise."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    value = (raw or "").strip().lower()
    if value in ("", "off"):
        return False
    if value == "on":
        return True
    raise KdtreeConfigError(
        f"{ENV}={raw!r} is not valid: expected 'on' or 'off' (or leave it unset for off)"
    )


def _describe(params: list[tuple[str, str, Any]]) -> str:
    parts = []
    for name, kind, default in params:
        s = name if kind == "POSITIONAL_OR_KEYWORD" else f"{name} [{kind}]"
        parts.append(s if default is _E else f"{s}={default!r}")
    return "(" + ", ".join(parts) + ")"


def check_signature(func: Callable[..., Any]) -> tuple[bool, str]:
    """Are ``func``'s parameters exactly the ones the hook was written for?"""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as e:
        return False, f"cannot read the signature of {TARGET}: {e}"
    got = [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]
    want = [(n, "POSITIONAL_OR_KEYWORD", d) for n, d in EXPECTED_PARAMS]
    if got != want:
        return False, (
            f"{TARGET_CLASS}.{TARGET_METHOD} has parameters {_describe(got)} but the kdtree hook "
            f"was written for {_describe(want)} (SGLang {SUPPORTED[0]} to {SUPPORTED[1]}); not hooking"
        )
    return True, ""


def resolve_target() -> tuple[Callable[..., Any] | None, str]:
    """Import SGLang's Triton backend and return ``forward_extend`` (or None, reason)."""
    import importlib

    try:
        module = importlib.import_module(TARGET_MODULE)
    except Exception as e:  # noqa: BLE001 - report any import failure, keep SGLang's path
        return None, f"cannot import {TARGET_MODULE}: {type(e).__name__}: {e}"
    cls = getattr(module, TARGET_CLASS, None)
    if not isinstance(cls, type) or TARGET_METHOD not in vars(cls):  # an inherited one is not the hooked code
        return None, f"{TARGET_MODULE} has no {TARGET_CLASS}.{TARGET_METHOD} of its own (SGLang changed?); not hooking"
    return getattr(cls, TARGET_METHOD), ""


def _rank_label() -> str:
    """``tp <rank>`` once SGLang knows this process's tensor-parallel rank, else the pid."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return f"tp {int(get_parallel().tp_rank)}"
    except Exception:  # noqa: BLE001 - not written yet (plugin load), or no SGLang
        return f"pid {os.getpid()}"


#: At most this many fallback kinds are counted by name (they are fixed sentences, so
#: far fewer exist); any further one counts under OTHER_KIND.
MAX_KINDS = 64
OTHER_KIND = "other"

# Run-time fallback kinds of the hooked path (the predicates' kinds are in fallback.py).
K_LIBRARY = "kernel library failed to load"
K_DEVICE = "device not supported by the kernel library"
K_PREPARE = "cannot build the kernel's arguments"
K_KV_WRITE = "KV write failed (SGLang's path writes it)"
K_REFUSED = "kernel refused the batch"
K_FAILED = "kernel failed (switched off for this process)"
K_DISABLED = "kernel switched off for this process"


class _Runtime:
    """Per-process state: what was decided, what was logged, what ran. Bounded: the
    counters are keyed by kind (at most MAX_KINDS + 1 keys), each kind logged once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.enabled: bool | None = None  # None: not decided at plugin load
        self.reason = "plugin not loaded"
        self.library: Any = None
        self.library_checked = False
        self.disabled_reason: str | None = None  # set when the kernel is switched off mid-run
        self.devices: dict[int, tuple[bool, str]] = {}
        self.logged: set[str] = set()
        self.kernel_calls = 0
        self.plan_calls = {"made": 0, "read": 0}  # kernel calls that made / read the step plan
        self.fallbacks: dict[str, int] = {}
        # calls the kernel is meant for (TARGET_VERIFY of an MLA model) that SGLang's path served:
        # the figure that must stay 0 (prefill and decode calls are out of scope, not fallbacks)
        self.verify_fallbacks = 0

    def note(self, kind: str, level: int, detail: str = "") -> None:
        """Count a fallback by kind; log each kind once (with the first call's detail). ``level``
        below WARNING marks a call out of the kernel's scope (prefill, decode, another model)."""
        with self.lock:
            if kind not in self.fallbacks and len(self.fallbacks) >= MAX_KINDS:
                kind = OTHER_KIND
            self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1
            if level >= logging.WARNING:
                self.verify_fallbacks += 1
            first = kind not in self.logged
            self.logged.add(kind)
        if first:
            logger.log(level, "kdtree verify [%s]: falling back to SGLang's path: %s%s (logged once per "
                       "process; counts in plugin.status())", _rank_label(), kind, f" ({detail})" if detail else "")

    def disable(self, reason: str) -> None:
        with self.lock:
            first = self.disabled_reason is None
            self.disabled_reason = self.disabled_reason or reason
        if first:
            logger.warning("kdtree verify [%s]: off: %s (SGLang's path serves from now on)", _rank_label(), reason)

    def ensure_library(self) -> Any:
        if not self.library_checked:
            ok, reason, lib = fallback.library_status()
            self.library, self.library_checked = lib, True
            if not ok:
                self.disable(reason)
        return self.library

    def device_ok(self, device: torch.device) -> tuple[bool, str]:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        got = self.devices.get(idx)
        if got is None:
            cap = torch.cuda.get_device_capability(idx)
            ok, _, detail = fallback.device_supported(self.library, cap)
            got = (ok, detail)
            self.devices[idx] = got
            if ok:
                logger.info("kdtree verify [%s]: on, sm_%d%d, library %s", _rank_label(), cap[0], cap[1],
                            getattr(self.library, "path", "?"))
            else:
                logger.warning("kdtree verify [%s]: off on device %d: %s", _rank_label(), idx, detail)
        return got

    def count_kernel_call(self, plan: Any = None, make_plan: bool = False) -> None:
        """Count a call the kernel served; at 1, 2, 4, 8, ... calls log the counts (a server's
        log then says what ran without a per-call line; under CUDA graphs the hook runs, and
        counts, while SGLang captures: replays run the captured kernels without Python)."""
        with self.lock:
            self.kernel_calls += 1
            if plan is not None:
                self.plan_calls["made" if make_plan else "read"] += 1
            n, made, read, refused = self.kernel_calls, self.plan_calls["made"], self.plan_calls["read"], \
                self.verify_fallbacks
        if n & (n - 1) == 0:
            logger.info("kdtree verify [%s]: %d kernel calls (step plan made %d, read %d), %d verify calls on "
                        "SGLang's path", _rank_label(), n, made, read, refused)


_runtime = _Runtime()


def status() -> dict[str, Any]:
    """What the plugin decided and did in this process: enabled, reason, library,
    kernel_calls, plan_calls (of those, how many made and how many read the step plan),
    fallbacks (kind -> count) and verify_fallbacks (of those, the calls the kernel is meant
    for: TARGET_VERIFY of an MLA model)."""
    r = _runtime
    with r.lock:
        return {
            "enabled": r.enabled,
            "reason": r.reason,
            "disabled_reason": r.disabled_reason,
            "library": str(getattr(r.library, "path", "")) or None,
            "kernel_calls": r.kernel_calls,
            "plan_calls": dict(r.plan_calls),
            "fallbacks": dict(r.fallbacks),
            "verify_fallbacks": r.verify_fallbacks,
        }


def _off(reason: str) -> None:
    _runtime.enabled, _runtime.reason = False, reason
    logger.error("kdtree verify [%s]: off: %s", _rank_label(), reason)


@contextlib.contextmanager
def _load_time_logging() -> Iterator[None]:
    """Make load()'s lines reach the server's log.

    SGLang calls ``load_plugins()`` before it configures logging, both in ``launch_server``
    and at the top of each scheduler process. At that point the root logger has no handler
    and sits at WARNING, so an INFO line from load() is dropped. That would lose the "hook
    registered" and "off" lines, the ones that say what the plugin decided. While the root
    logger has no handler, the plugin's logger gets a stderr handler and INFO for the length
    of load(). Afterwards its lines go through whatever SGLang set up, and no line is
    printed twice.
    """
    if logging.getLogger().handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def load() -> None:
    """Entry point SGLang's ``load_plugins()`` calls in every process."""
    with _load_time_logging():
        _load()


def _load() -> None:
    try:
        on = read_switch()
    except KdtreeConfigError as e:
        logger.error("kdtree verify: %s", e)
        raise KdtreeConfigExit(f"kdtree verify: {e}; stopping (SGLang would otherwise serve without it)") from e
    _runtime.reset()
    if not on:
        _runtime.enabled = False
        raw = os.environ.get(ENV)
        _runtime.reason = f"{ENV}={raw}" if raw else f"{ENV} is unset"
        logger.info("kdtree verify: off: %s", _runtime.reason)
        return
    func, reason = resolve_target()
    if func is not None:
        ok, reason = check_signature(func)
        if not ok:
            func = None
    if func is None:
        _off(reason)
        return
    from kdtree_engine.sglang import drift

    missing = drift.check()
    if missing:
        _off(f"SGLang lacks what the hooked path reads: {', '.join(missing)}; not hooking")
        return
    lib = _runtime.ensure_library()
    if lib is None:
        _runtime.enabled, _runtime.reason = False, _runtime.disabled_reason or "kernel library failed to load"
        return  # ensure_library logged the warning
    _warn_version()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, verify_hook, HookType.AROUND)
    _runtime.enabled, _runtime.reason = True, f"{ENV}=on"
    logger.info(
        "kdtree verify [%s]: hook registered on %s.%s (%s=on; library %s, built for %s); the device is checked "
        "at the first verify step", _rank_label(), TARGET_CLASS, TARGET_METHOD, ENV, lib.path,
        getattr(lib, "archs", "?"),
    )


def _warn_version() -> None:
    from kdtree_engine.sglang import drift

    found = drift.sglang_version()
    if not fallback.in_supported_range(found):
        logger.warning(
            "kdtree verify: written for SGLang %s to %s, found %s; it has every name the hooked path reads "
            "and the hooked signature matches, hooking anyway", SUPPORTED[0], SUPPORTED[1], found,
        )


def _split_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """forward_extend's arguments by name (the signature was checked at registration)."""
    if len(args) > len(_ARG_NAMES):
        raise TypeError("too many arguments")
    vals = dict(zip(_ARG_NAMES, args, strict=False))
    for k, v in kwargs.items():
        if k not in _ARG_NAMES or k in vals:
            raise TypeError(f"unexpected argument {k!r}")
        vals[k] = v
    for k, d in _DEFAULTS.items():
        vals.setdefault(k, d)
    if len(vals) != len(_ARG_NAMES):
        raise TypeError("missing arguments")
    return vals


def verify_hook(original: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``TritonAttnBackend.forward_extend``."""
    try:
        call = VerifyCall(backend=backend, **_split_args(args, kwargs))
    except TypeError:
        return original(backend, *args, **kwargs)  # let SGLang raise its own error
    d = fallback.evaluate(call)
    if not d.ok:
        _runtime.note(d.kind, d.level, d.detail)
        return original(backend, *args, **kwargs)
    if _runtime.disabled_reason is not None:
        _runtime.note(K_DISABLED, logging.WARNING, _runtime.disabled_reason)
        return original(backend, *args, **kwargs)
    return run_verify(original, call, args, kwargs)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _prefix_hint(forward_batch: Any, bs: int) -> torch.Tensor | None:
    """Prefix lengths already on the host (no sync); never baked into a CUDA graph.
    Only a hint (tuning and extra checks): None when SGLang has none."""
    lens = forward_batch.seq_lens_cpu
    if not isinstance(lens, torch.Tensor) or lens.device.type != "cpu" or lens.numel() != bs:
        return None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return lens


def prepare(call: VerifyCall, lib: Any) -> tuple[Any, torch.Tensor]:
    """The kernel's arguments, one :class:`~kdtree_engine.kernel.args.VerifyArgs` built from
    SGLang's own tensors and metadata (no device read), and the tensor SGLang's
    forward_extend returns, ``[tokens, heads * 512]``, which the kernel writes (``out`` is a
    view of it). ``lib``: the loaded kernel library (whether it takes a step plan)."""
    from kdtree_engine.kernel import op

    b, layer, fb, m = call.backend, call.layer, call.forward_batch, call.metadata
    heads = layer.tp_q_head_num
    attn_out = getattr(fb, "_attn_output", None)  # as SGLang's forward_extend reads it (optional there)
    o = attn_out if attn_out is not None else call.q.new_empty((call.q.shape[0], heads * layer.v_head_dim))
    q = call.q.view(-1, heads, layer.qk_head_dim)
    kv_buffer = b.token_to_kv_pool.get_key_buffer(layer.layer_id)
    # k None: SGLang wrote the drafts' latents to the pool at out_cache_loc; the kernel
    # reads them there (no gather). The indptrs go in as SGLang keeps them (int64 or int32).
    k_ext = None if call.k is None else call.k.contiguous()
    mask_indptr = _as_dtype(m.mask_indptr, torch.int64)
    prefix_lens = _prefix_hint(fb, m.qo_indptr.numel() - 1)
    target = op.resolve_target(None)  # KDTREE_TARGET, read per call as verify_attention does
    # last: it marks the step's plan as made by this call
    plan, make_plan = step_plan(call, q.device, lib)
    args = op.VerifyArgs(
        q=q, k_ext=k_ext, kv_buffer=kv_buffer, qo_indptr=m.qo_indptr, kv_indptr=m.kv_indptr,
        kv_indices=m.kv_indices, custom_mask=m.custom_mask, mask_indptr=mask_indptr,
        sm_scale=float(layer.scaling), max_n=int(m.max_extend_len), out=o.view(-1, heads, layer.v_head_dim),
        prefix_lens_cpu=prefix_lens, target=target, draft_slots=fb.out_cache_loc if call.k is None else None,
        plan=plan, make_plan=make_plan,
    )
    return args, o


class _StepPlan:
    """A backend's step plan and the step (its ``forward_metadata``, weakly) it was made for."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self.step: weakref.ref[Any] | None = None


def step_plan(call: VerifyCall, device: torch.device, lib: Any) -> tuple[Any, bool]:
    """(plan, make): the backend's plan, to be made by this call when it is the first hooked
    call of its step (SGLang builds a new ``forward_metadata`` per step), else read. (None,
    False) for a library without plans (an older ABI)."""
    from kdtree_engine.kernel.op import VerifyPlan

    if not getattr(lib, "has_plan", False):
        return None, False
    backend, meta = call.backend, call.metadata
    try:
        ref = weakref.ref(meta)
    except TypeError:  # a metadata object without weak references: no step to key on, no plan
        return None, False
    sp = getattr(backend, "_kdtree_step_plan", None)
    if sp is None or sp.plan.device != device:
        sp = _StepPlan(VerifyPlan(device))
        backend._kdtree_step_plan = sp
    make = sp.step is None or sp.step() is not meta
    if make:
        sp.step = ref
    return sp.plan, make


def save_kv(call: VerifyCall) -> bool:
    """Save the drafts' KV to the pool with SGLang's own code, as forward_extend does
    (the predicates guarantee no KV scales and no DCP). Returns whether it wrote."""
    if call.k is None or not call.save_kv_cache:
        return False
    call.backend._set_kv_buffer(call.forward_batch, call.layer, write_loc(call), call.k, call.v)
    return True


@functools.cache
def _marked_write_loc(cls: type) -> bool:
    """Does this release's KVWriteLoc carry a ``physical`` mark (0.5.23), so that only its
    ``for_batch`` builds a location its pools accept?"""
    return "physical" in {f.name for f in dataclasses.fields(cls)}


def write_loc(call: VerifyCall) -> Any:
    """The KV write location exactly as the release's own ``forward_extend`` builds it:
    ``KVWriteLoc.for_batch`` in 0.5.23, the plain ``KVWriteLoc(loc, swa_loc, full_loc=...)`` in
    0.5.17 (the drift check has confirmed one of the two). A 0.5.23-style class without
    ``for_batch`` raises here, and the call goes to SGLang's path."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    md = call.metadata
    if _marked_write_loc(KVWriteLoc):
        return KVWriteLoc.for_batch(call.forward_batch, swa_loc=md.swa_out_cache_loc)
    return KVWriteLoc(call.forward_batch.out_cache_loc, md.swa_out_cache_loc,
                      full_loc=fallback.optional(md, "out_cache_loc_full_physical"))


def _launch(a: Any) -> None:
    """Check prepare()'s arguments and run the kernel into their ``out``."""
    from kdtree_engine.kernel.op import verify

    verify(a)


def _describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def run_verify(original: Callable[..., Any], call: VerifyCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Save KV as SGLang does, then the kernel; fall back to SGLang's path on any refusal
    or error. Before the KV write, the fallback is SGLang's call as given (it writes the
    KV); after it, the same call with ``save_kv_cache=False`` (written once)."""
    from kdtree_engine.kernel.op import VerifyArgumentError

    backend = call.backend
    try:
        lib = _runtime.ensure_library()
    except Exception as e:  # noqa: BLE001
        lib = None
        _runtime.disable(f"kernel library failed to load: {_describe_error(e)}")
    if lib is None:
        _runtime.note(K_LIBRARY, logging.WARNING, _runtime.disabled_reason or "")
        return original(backend, *args, **kwargs)
    try:
        ok, why = _runtime.device_ok(call.q.device)
    except Exception as e:  # noqa: BLE001 - no CUDA, a device torch cannot query
        ok, why = False, _describe_error(e)
    if not ok:
        _runtime.note(K_DEVICE, logging.WARNING, why)
        return original(backend, *args, **kwargs)
    try:
        a, o = prepare(call, lib)
    except Exception as e:  # noqa: BLE001 - a layout SGLang's path handles and ours does not
        _runtime.note(K_PREPARE, logging.WARNING, _describe_error(e))
        return original(backend, *args, **kwargs)
    try:
        save_kv(call)
    except Exception as e:  # noqa: BLE001 - SGLang's private KV-write API changed or refused
        _runtime.note(K_KV_WRITE, logging.WARNING, _describe_error(e))
        return original(backend, *args, **kwargs)  # save_kv_cache as given: SGLang writes the KV
    try:
        _launch(a)
    except VerifyArgumentError as e:  # this batch only; the KV is saved already
        _runtime.note(K_REFUSED, logging.WARNING, str(e))
        return _original_without_save(original, call)
    except Exception as e:  # noqa: BLE001 - library/arch/launch failure: keep serving via SGLang
        _runtime.disable(f"kernel failed: {_describe_error(e)}")
        _runtime.note(K_FAILED, logging.WARNING)
        return _original_without_save(original, call)
    _runtime.count_kernel_call(a.plan, a.make_plan)
    return o


def _original_without_save(original: Callable[..., Any], call: VerifyCall) -> Any:
    return original(
        call.backend, call.q, call.k, call.v, call.layer, call.forward_batch,
        save_kv_cache=False, sinks=call.sinks, score_mod=call.score_mod, aux_tensors=call.aux_tensors,
    )
