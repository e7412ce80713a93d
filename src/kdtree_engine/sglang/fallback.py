"""When the plugin hands a ``forward_extend`` call to the owned kernel, and why not.

Every rule is one small predicate over a :class:`VerifyCall` returning a
:class:`Verdict`: accepted, or refused with a *kind* (a fixed sentence with no
per-batch numbers: the key the plugin counts and logs once) and a *detail* (the
values of the first such call, logged with it). :func:`evaluate` runs them in
order and returns the first refusal. The hook calls SGLang's original code for
every refused call, so a predicate that is too strict costs speed, never
correctness.

The predicates fail closed: they read SGLang's attributes directly (no
``getattr`` default that would read a renamed attribute as "supported"), every
name they read is listed in :data:`REQUIRED` and checked on SGLang's classes
when the hook is registered (:func:`kdtree_engine.sglang.drift.check`), and a
predicate that raises refuses the call.

The predicates read only host-side facts (Python attributes, tensor dtypes and
shapes): none reads device memory, so the decision is free under CUDA-graph
capture.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kdtree_engine.kernel.op import HEAD_DIM, MAX_DRAFTS, MAX_HEADS, V_DIM


class Verdict(NamedTuple):
    """Result of one predicate."""

    ok: bool
    kind: str = ""  # why it was refused: a fixed sentence, the counter's key
    detail: str = ""  # the values behind it (logged with the first refusal of the kind)


OK = Verdict(True)


class Decision(NamedTuple):
    """Result of :func:`evaluate`."""

    ok: bool
    kind: str
    level: int
    detail: str = ""


#: The SGLang releases the plugin is written for and checked against (the drift check runs on
#: both ends on CPU: ``nox -s drift``). Inside the range a name of :data:`OPTIONAL` may be absent;
#: outside it every name is required, so an unknown release hooks only if it has them all.
SUPPORTED = ("0.5.17", "0.5.23")

_TB = ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend")
_MD = ("sglang.srt.layers.attention.triton_backend", "ForwardMetadata")
_FB = ("sglang.srt.model_executor.forward_batch_info", "ForwardBatch")
_KW = ("sglang.srt.mem_cache.memory_pool", "KVWriteLoc")

#: Every attribute and method of SGLang's objects that the predicates, ``prepare``
#: and ``save_kv`` read in every supported release: (module, class) -> names. The drift check
#: confirms each exists on the class (as a class attribute, a dataclass field, or an attribute
#: some method of the class or its bases assigns) before the hook is registered.
REQUIRED: dict[tuple[str, str], tuple[str, ...]] = {
    _TB: (
        "use_mla", "token_to_kv_pool", "dcp_size", "forward_metadata", "enable_deterministic",
        "use_verify_splitkv", "use_sliding_window_kv_pool", "forward_extend", "_set_kv_buffer",
    ),
    _MD: ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", "max_extend_len",
          "swa_out_cache_loc"),
    ("sglang.srt.layers.radix_attention", "RadixAttention"): (
        "tp_q_head_num", "qk_head_dim", "v_head_dim", "scaling", "layer_id", "k_scale", "v_scale",
        "sliding_window_size", "logit_cap", "logit_capping_method", "xai_temperature_len", "attn_type",
        "is_cross_attention",
    ),
    _FB: ("forward_mode", "out_cache_loc", "seq_lens_cpu", "_attn_output"),
    ("sglang.srt.model_executor.forward_batch_info", "ForwardMode"): ("is_target_verify", "name"),
    ("sglang.srt.mem_cache.memory_pool", "MLATokenToKVPool"): ("dtype", "store_dtype", "get_key_buffer"),
}

#: Names one end of :data:`SUPPORTED` lacks, with the value that means "that path does not exist
#: in this release". 0.5.17 has no diffusion-LM attention, no shared-KV verify kernel and no
#: dense fp8 chunked prefill; 0.5.23 has no ``_translate_kv_loc`` and no
#: ``out_cache_loc_full_physical`` (0.5.17's unified-pool id translation and write location),
#: since its ``KVWriteLoc.for_batch`` carries that instead.
OPTIONAL: dict[tuple[str, str], dict[str, Any]] = {
    _TB: {"dllm_attention": None, "use_verify_shared_kv": False, "use_dense_fp8_chunked_prefill": False,
          "_translate_kv_loc": None},
    _MD: {"out_cache_loc_full_physical": None},
}

#: Where one of several spellings must exist, each (names it has, names it must not have): the KV
#: write location SGLang's ``forward_extend`` builds is ``KVWriteLoc.for_batch(...)`` in 0.5.23,
#: whose location carries the batch's ``physical`` mark, and the plain ``KVWriteLoc(loc, swa_loc,
#: full_loc=...)`` in 0.5.17, which has no such mark (``save_kv`` builds it as the release does; a
#: release with the mark but without ``for_batch`` fits neither and is not hooked).
ONE_OF: dict[tuple[str, str], tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = {
    _KW: ((("for_batch",), ()), (("loc", "swa_loc", "full_loc"), ("physical",))),
}

_OPTIONAL_BY_NAME = {name: absent for names in OPTIONAL.values() for name, absent in names.items()}


def optional(obj: Any, name: str) -> Any:
    """``obj.name``, or the value of :data:`OPTIONAL` that means its path is absent in this
    release. Only for names in OPTIONAL: the drift check has confirmed that the release is
    in :data:`SUPPORTED` (where absence has that meaning) or has the name."""
    return getattr(obj, name, _OPTIONAL_BY_NAME[name])


def in_supported_range(version: str | None) -> bool:
    """Is ``version`` (SGLang's ``__version__``) within :data:`SUPPORTED`, ends included?"""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version or "")
    except InvalidVersion:
        return False
    return Version(SUPPORTED[0]) <= v <= Version(SUPPORTED[1])


@dataclass(frozen=True)
class VerifyCall:
    """The arguments of one ``TritonAttnBackend.forward_extend`` call."""

    backend: Any
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    layer: Any
    forward_batch: Any
    save_kv_cache: bool = True
    sinks: Any = None
    score_mod: Any = None
    aux_tensors: Any = None

    @property
    def metadata(self) -> Any:
        return self.backend.forward_metadata


def _no(kind: str, detail: str = "") -> Verdict:
    return Verdict(False, kind, detail)


# --- scope: is this a call the kernel is meant for at all? -------------------------------


def is_target_verify(c: VerifyCall) -> Verdict:
    """Only the TARGET_VERIFY forward (tree verify of the drafts)."""
    mode = c.forward_batch.forward_mode
    if not mode.is_target_verify():
        return _no("not a TARGET_VERIFY forward", f"forward mode {mode.name}")
    return OK


def is_mla(c: VerifyCall) -> Verdict:
    """Only MLA models (one shared latent KV head)."""
    if c.backend.use_mla is not True:
        return _no("not an MLA model")
    return OK


# --- coverage: a verify call the kernel does not cover -----------------------------------


def head_dims(c: VerifyCall) -> Verdict:
    """576-wide latent (512 nope + 64 rope) in, 512 out."""
    qk, vd = c.layer.qk_head_dim, c.layer.v_head_dim
    if (qk, vd) != (HEAD_DIM, V_DIM):
        return _no(f"head dims not supported (the kernel needs {HEAD_DIM}/{V_DIM})", f"head dims {qk}/{vd}")
    return OK


def activation_dtype(c: VerifyCall) -> Verdict:
    """bf16 queries and draft latents."""
    for name, t in (("q", c.q), ("k", c.k)):
        if t is not None and t.dtype != torch.bfloat16:
            return _no(f"{name} dtype not supported (the kernel needs torch.bfloat16)", f"{name} dtype {t.dtype}")
    return OK


def kv_cache_dtype(c: VerifyCall) -> Verdict:
    """A bf16 KV pool without per-layer KV scales (no fp8 / fp4 KV cache)."""
    pool = c.backend.token_to_kv_pool
    dtypes = {pool.dtype, pool.store_dtype}
    for dt in dtypes:
        if isinstance(dt, torch.dtype) and dt.is_floating_point and dt.itemsize == 1:
            return _no("fp8 KV cache not supported", f"fp8 KV cache ({dt})")
    if dtypes != {torch.bfloat16}:
        return _no("KV cache dtype not supported (the kernel needs torch.bfloat16)",
                   f"KV cache dtype {sorted(map(str, dtypes))}")
    if c.layer.k_scale is not None or c.layer.v_scale is not None:
        return _no("scaled KV cache (layer k_scale / v_scale) not supported")
    return OK


def no_sliding_window(c: VerifyCall) -> Verdict:
    window = c.layer.sliding_window_size
    if window is not None and window > -1:
        return _no("sliding window attention not supported", f"sliding window {window}")
    if c.backend.use_sliding_window_kv_pool:
        return _no("sliding-window KV pool not supported")
    return OK


def no_logit_cap(c: VerifyCall) -> Verdict:
    cap = c.layer.logit_cap or 0.0
    if cap > 0:
        return _no("logit cap not supported", f"logit cap {cap}")
    method = c.layer.logit_capping_method
    if method != "tanh":  # SGLang's own path rejects it; let it say so
        return _no("logit capping method not supported", f"logit capping method {method!r}")
    return OK


def positive_scale(c: VerifyCall) -> Verdict:
    scaling = c.layer.scaling
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) \
            or scaling <= 0:
        return _no("softmax scale not supported (the kernel needs a positive finite scale)",
                   f"softmax scale {scaling!r}")
    return OK


def no_sinks(c: VerifyCall) -> Verdict:
    if c.sinks is not None:
        return _no("attention sinks not supported")
    return OK


def no_score_mod(c: VerifyCall) -> Verdict:
    if c.score_mod is not None or c.aux_tensors is not None:
        return _no("score_mod / aux_tensors not supported")
    xai = c.layer.xai_temperature_len
    if xai is not None and xai > 0:
        return _no("xai temperature scaling not supported", f"xai_temperature_len {xai}")
    return OK


def no_dcp(c: VerifyCall) -> Verdict:
    dcp = c.backend.dcp_size
    if dcp != 1:
        return _no("decode context parallelism not supported", f"dcp_size {dcp}")
    return OK


def causal_decoder(c: VerifyCall) -> Verdict:
    """SGLang's verify is causal decoder attention plus the tree mask."""
    if c.layer.is_cross_attention:
        return _no("cross attention not supported")
    attn_type = c.layer.attn_type.name
    if attn_type in ("ENCODER_ONLY", "DECODER_BIDIRECTIONAL"):
        return _no("non-causal attention not supported", f"attention type {attn_type}")
    return OK


def plain_backend_mode(c: VerifyCall) -> Verdict:
    """No other special path of SGLang's Triton backend is active."""
    b = c.backend
    if optional(b, "dllm_attention") is not None:
        return _no("diffusion-LM attention path not supported")
    if b.enable_deterministic:
        return _no("deterministic inference (SGLang's unified kernel) keeps SGLang's path")
    if optional(b, "use_verify_shared_kv") or b.use_verify_splitkv:
        return _no("SGLang's own split-KV verify kernel is active")
    if optional(b, "use_dense_fp8_chunked_prefill"):
        return _no("dense fp8 chunked prefill path not supported")
    return OK


def physical_slot_ids(c: VerifyCall) -> Verdict:
    """The slot ids the kernel reads are the pool's rows: no unified (virtual-id) pool, whose ids
    SGLang 0.5.17 translates before use (``_translate_kv_loc``, ``out_cache_loc_full_physical``).
    0.5.23 marks such ids on the write location it builds (``KVWriteLoc.for_batch``), which
    ``save_kv`` uses as it is; an MLA model's pool there holds physical ids."""
    if optional(c.backend, "_translate_kv_loc") is not None:
        return _no("unified (virtual slot id) KV pool not supported")
    if c.metadata is not None and optional(c.metadata, "out_cache_loc_full_physical") is not None:
        return _no("unified (virtual slot id) KV pool not supported")
    return OK


def kv_inputs(c: VerifyCall) -> Verdict:
    """k and v both given (one row per query) or both None (read back from the pool)."""
    if (c.k is None) != (c.v is None):
        return _no("only one of k and v given")  # SGLang's path raises its own error
    if c.k is not None and c.k.shape[0] != c.q.shape[0]:
        return _no("k rows differ from query rows (one-shot MHA)",
                   f"k has {c.k.shape[0]} rows for {c.q.shape[0]} query rows")
    return OK


def has_verify_metadata(c: VerifyCall) -> Verdict:
    m = c.metadata
    if m is None:
        return _no("no forward metadata")
    for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.mask_indptr):
        if t is None:
            return _no("forward metadata lacks an index tensor")
    if m.custom_mask is None:
        return _no("custom_mask is None (verify without a tree mask)")
    return OK


def batch_limits(c: VerifyCall) -> Verdict:
    """At most 128 heads per GPU and 128 drafts per request."""
    heads = c.layer.tp_q_head_num
    if not isinstance(heads, int) or not 1 <= heads <= MAX_HEADS:
        return _no(f"query heads per GPU not supported (1..{MAX_HEADS})", f"{heads} query heads per GPU")
    n = c.metadata.max_extend_len
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFTS:
        return _no(f"draft tokens per request not supported (1..{MAX_DRAFTS})", f"{n} draft tokens per request")
    return OK


#: Predicates whose refusal is the ordinary case (prefill, decode, other models): logged at INFO.
SCOPE: tuple[Callable[[VerifyCall], Verdict], ...] = (is_target_verify, is_mla)

#: Predicates whose refusal means a verify call the kernel does not cover: logged at WARNING.
COVERAGE: tuple[Callable[[VerifyCall], Verdict], ...] = (
    head_dims,
    activation_dtype,
    kv_cache_dtype,
    no_sliding_window,
    no_logit_cap,
    positive_scale,
    no_sinks,
    no_score_mod,
    no_dcp,
    causal_decoder,
    plain_backend_mode,
    physical_slot_ids,
    kv_inputs,
    has_verify_metadata,
    batch_limits,
)

#: The kind of a refusal by a predicate that raised (SGLang handed us something unexpected).
PREDICATE_FAILED = "a fallback predicate could not read the call (SGLang changed?)"


def evaluate(call: VerifyCall) -> Decision:
    """Run every predicate; return the first refusal (ok, kind, log level, detail).
    A predicate that raises refuses the call: the plugin fails closed."""
    for preds, level in ((SCOPE, logging.INFO), (COVERAGE, logging.WARNING)):
        for pred in preds:
            try:
                ok, kind, detail = pred(call)
            except Exception as e:  # noqa: BLE001 - anything unexpected keeps SGLang's path
                return Decision(False, PREDICATE_FAILED, logging.WARNING, f"{pred.__name__}: {type(e).__name__}: {e}")
            if not ok:
                return Decision(False, kind, level, detail)
    return Decision(True, "", logging.DEBUG)


# --- the kernel library ----------------------------------------------------------------


def library_status() -> tuple[bool, str, Any]:
    """Load the kernel library; (ok, reason, library). Never raises."""
    try:
        from kdtree_engine.kernel import library

        lib = library.load()
    except Exception as e:  # noqa: BLE001 - any failure means: keep SGLang's path
        return False, f"kernel library failed to load: {e}", None
    return True, "", lib


def library_archs(archs: str) -> tuple[set[int], set[int]]:
    """Targets named in the library's build info: ("sm_90a,sm_120a,compute_120") ->
    ({90, 120} binaries, {120} PTX)."""
    import re

    sass = {int(m) for m in re.findall(r"sm_(\d+)", archs or "")}
    ptx = {int(m) for m in re.findall(r"compute_(\d+)", archs or "")}
    return sass, ptx


def device_supported(lib: Any, capability: tuple[int, int]) -> Verdict:
    """Does the library hold code for this device (its binary, or PTX of an older or equal
    target)? Build info that names no target is not refused here: a launch failure
    (ENOARCH) then falls back."""
    cc = capability[0] * 10 + capability[1]
    info = getattr(lib, "archs", "")
    sass, ptx = library_archs(info)
    if (sass or ptx) and cc not in sass and not any(p <= cc for p in ptx):
        return _no("kernel library has no code for this device", f"kernel library built for {info} has no code for sm_{cc}")
    return OK
