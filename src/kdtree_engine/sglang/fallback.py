"""When the plugin hands a ``forward_extend`` call to the owned kernel, and why not.

Every rule is one small predicate over a :class:`VerifyCall` returning
``(ok, reason)``; :func:`evaluate` runs them in order and returns the first
refusal. The hook calls SGLang's original code for every refused call, so a
predicate that is too strict costs speed, never correctness.

The predicates read only host-side facts (Python attributes, tensor dtypes and
shapes): none reads device memory, so the decision is free under CUDA-graph
capture.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kdtree_engine.kernel.op import HEAD_DIM, MAX_DRAFTS, MAX_HEADS, V_DIM

#: Result of one predicate: (accepted, reason it was refused or "").
Verdict = tuple[bool, str]

OK: Verdict = (True, "")


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
        return getattr(self.backend, "forward_metadata", None)


def _no(reason: str) -> Verdict:
    return False, reason


# --- scope: is this a call the kernel is meant for at all? -------------------------------


def is_target_verify(c: VerifyCall) -> Verdict:
    """Only the TARGET_VERIFY forward (tree verify of the drafts)."""
    mode = getattr(c.forward_batch, "forward_mode", None)
    is_tv = getattr(mode, "is_target_verify", None)
    if is_tv is None or not is_tv():
        return _no(f"not a TARGET_VERIFY forward ({getattr(mode, 'name', mode)})")
    return OK


def is_mla(c: VerifyCall) -> Verdict:
    """Only MLA models (one shared latent KV head)."""
    if getattr(c.backend, "use_mla", False) is not True:
        return _no("not an MLA model")
    return OK


# --- coverage: a verify call the kernel does not cover -----------------------------------


def head_dims(c: VerifyCall) -> Verdict:
    """576-wide latent (512 nope + 64 rope) in, 512 out."""
    qk, vd = getattr(c.layer, "qk_head_dim", None), getattr(c.layer, "v_head_dim", None)
    if (qk, vd) != (HEAD_DIM, V_DIM):
        return _no(f"head dims {qk}/{vd} not supported (the kernel needs {HEAD_DIM}/{V_DIM})")
    return OK


def activation_dtype(c: VerifyCall) -> Verdict:
    """bf16 queries and draft latents."""
    for name, t in (("q", c.q), ("k", c.k)):
        if t is not None and t.dtype != torch.bfloat16:
            return _no(f"{name} dtype {t.dtype} not supported (the kernel needs torch.bfloat16)")
    return OK


def kv_cache_dtype(c: VerifyCall) -> Verdict:
    """A bf16 KV pool without per-layer KV scales (no fp8 / fp4 KV cache)."""
    pool = getattr(c.backend, "token_to_kv_pool", None)
    dtypes = {getattr(pool, "dtype", None), getattr(pool, "store_dtype", getattr(pool, "dtype", None))}
    for dt in dtypes:
        if isinstance(dt, torch.dtype) and dt.is_floating_point and dt.itemsize == 1:
            return _no(f"fp8 KV cache ({dt}) not supported")
    if dtypes != {torch.bfloat16}:
        return _no(f"KV cache dtype {sorted(map(str, dtypes))} not supported (the kernel needs torch.bfloat16)")
    if getattr(c.layer, "k_scale", None) is not None or getattr(c.layer, "v_scale", None) is not None:
        return _no("scaled KV cache (layer k_scale / v_scale) not supported")
    return OK


def no_sliding_window(c: VerifyCall) -> Verdict:
    window = getattr(c.layer, "sliding_window_size", None)
    if window is not None and window > -1:
        return _no(f"sliding window attention (window {window}) not supported")
    if getattr(c.backend, "use_sliding_window_kv_pool", False):
        return _no("sliding-window KV pool not supported")
    return OK


def no_logit_cap(c: VerifyCall) -> Verdict:
    cap = getattr(c.layer, "logit_cap", 0.0) or 0.0
    if cap > 0:
        return _no(f"logit cap ({cap}) not supported")
    method = getattr(c.layer, "logit_capping_method", "tanh")
    if method != "tanh":  # SGLang's own path rejects it; let it say so
        return _no(f"logit capping method {method!r} not supported")
    return OK


def positive_scale(c: VerifyCall) -> Verdict:
    scaling = getattr(c.layer, "scaling", None)
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not math.isfinite(scaling) \
            or scaling <= 0:
        return _no(f"softmax scale {scaling!r} not supported (the kernel needs a positive finite scale)")
    return OK


def no_sinks(c: VerifyCall) -> Verdict:
    if c.sinks is not None:
        return _no("attention sinks not supported")
    return OK


def no_score_mod(c: VerifyCall) -> Verdict:
    if c.score_mod is not None or c.aux_tensors is not None:
        return _no("score_mod / aux_tensors not supported")
    xai = getattr(c.layer, "xai_temperature_len", -1)
    if xai is not None and xai > 0:
        return _no(f"xai temperature scaling (xai_temperature_len {xai}) not supported")
    return OK


def no_dcp(c: VerifyCall) -> Verdict:
    dcp = getattr(c.backend, "dcp_size", None)
    if dcp != 1:
        return _no(f"decode context parallelism (dcp_size {dcp}) not supported")
    return OK


def causal_decoder(c: VerifyCall) -> Verdict:
    """SGLang's verify is causal decoder attention plus the tree mask."""
    attn_type = getattr(getattr(c.layer, "attn_type", None), "name", None)
    if getattr(c.layer, "is_cross_attention", False):
        return _no("cross attention not supported")
    if attn_type in ("ENCODER_ONLY", "DECODER_BIDIRECTIONAL"):
        return _no(f"non-causal attention ({attn_type}) not supported")
    return OK


def plain_backend_mode(c: VerifyCall) -> Verdict:
    """No other special path of SGLang's Triton backend is active."""
    b = c.backend
    if getattr(b, "dllm_attention", None) is not None:
        return _no("diffusion-LM attention path not supported")
    if getattr(b, "enable_deterministic", False):
        return _no("deterministic inference (SGLang's unified kernel) keeps SGLang's path")
    if getattr(b, "use_verify_shared_kv", False) or getattr(b, "use_verify_splitkv", False):
        return _no("SGLang's own split-KV verify kernel is active")
    if getattr(b, "use_dense_fp8_chunked_prefill", False):
        return _no("dense fp8 chunked prefill path not supported")
    return OK


def kv_inputs(c: VerifyCall) -> Verdict:
    """k and v both given (one row per query) or both None (read back from the pool)."""
    if (c.k is None) != (c.v is None):
        return _no("only one of k and v given")  # SGLang's path raises its own error
    if c.k is not None and c.k.shape[0] != c.q.shape[0]:
        return _no(f"k has {c.k.shape[0]} rows for {c.q.shape[0]} query rows (one-shot MHA)")
    return OK


def has_verify_metadata(c: VerifyCall) -> Verdict:
    m = c.metadata
    if m is None:
        return _no("no forward metadata")
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "mask_indptr"):
        if getattr(m, name, None) is None:
            return _no(f"forward metadata has no {name}")
    if getattr(m, "custom_mask", None) is None:
        return _no("custom_mask is None (verify without a tree mask)")
    return OK


def batch_limits(c: VerifyCall) -> Verdict:
    """At most 128 heads per GPU and 128 drafts per request."""
    heads = getattr(c.layer, "tp_q_head_num", None)
    if not isinstance(heads, int) or not 1 <= heads <= MAX_HEADS:
        return _no(f"{heads} query heads per GPU not supported (1..{MAX_HEADS})")
    n = getattr(c.metadata, "max_extend_len", None)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFTS:
        return _no(f"{n} draft tokens per request not supported (1..{MAX_DRAFTS})")
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
    kv_inputs,
    has_verify_metadata,
    batch_limits,
)


def evaluate(call: VerifyCall) -> tuple[bool, str, int]:
    """Run every predicate; return (ok, reason, log level) of the first refusal."""
    for pred in SCOPE:
        ok, reason = pred(call)
        if not ok:
            return False, reason, logging.INFO
    for pred in COVERAGE:
        ok, reason = pred(call)
        if not ok:
            return False, reason, logging.WARNING
    return True, "", logging.DEBUG


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
    """Targets named in the library's build info: ("sm_90a,sm_120,compute_120") ->
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
        return _no(f"kernel library built for {info} has no code for sm_{cc}")
    return OK
