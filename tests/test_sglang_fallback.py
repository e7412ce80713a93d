"""Fallback predicates of the SGLang plugin, on SGLang's real layer, pool and forward modes (CPU)."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.sglang import fallback
from kdtree_engine.sglang.fallback import VerifyCall
from kdtree_pipeline.testing import standins as _standins

_standins.install_torchvision_standin()  # CPU torch cannot load the CUDA torchvision wheels
if torch.cuda.is_available():  # on CUDA, SGLang's module imports need sgl_kernel (absent on the GPU host)
    _standins.install_sgl_kernel_standin()

from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

pytestmark = pytest.mark.sglang

T, H, N = 8, 16, 4


def make_layer(**over) -> RadixAttention:
    layer = RadixAttention(num_heads=H, head_dim=576, scaling=576**-0.5, num_kv_heads=1, layer_id=0, v_head_dim=512)
    for k, v in over.items():
        setattr(layer, k, v)
    return layer


def make_call(**over) -> VerifyCall:
    """A TARGET_VERIFY call every predicate accepts; ``over`` replaces fields."""
    pool = SimpleNamespace(dtype=torch.bfloat16, store_dtype=torch.bfloat16)
    meta = SimpleNamespace(qo_indptr=torch.arange(0, 3 * N, N, dtype=torch.int32),
                           kv_indptr=torch.tensor([0, 5, 9], dtype=torch.int32),
                           kv_indices=torch.arange(9), custom_mask=torch.ones(64, dtype=torch.bool),
                           mask_indptr=torch.tensor([0, 36, 88]), max_extend_len=N)
    backend = SimpleNamespace(use_mla=True, token_to_kv_pool=pool, dcp_size=1, forward_metadata=meta,
                              dllm_attention=None, enable_deterministic=False, use_verify_shared_kv=False,
                              use_verify_splitkv=False, use_dense_fp8_chunked_prefill=False,
                              use_sliding_window_kv_pool=False)
    k = torch.zeros(T, 1, 576, dtype=torch.bfloat16)
    call = VerifyCall(backend=backend, q=torch.zeros(T, H * 576, dtype=torch.bfloat16), k=k, v=k[..., :512],
                      layer=make_layer(), forward_batch=SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY))
    return replace(call, **over)


def test_a_plain_mla_verify_call_is_accepted():
    assert fallback.evaluate(make_call()) == (True, "", logging.DEBUG, "")


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND_V2, ForwardMode.IDLE])
def test_other_forward_modes_are_refused_at_info(mode):
    ok, kind, level, detail = fallback.evaluate(make_call(forward_batch=SimpleNamespace(forward_mode=mode)))
    assert not ok and kind == "not a TARGET_VERIFY forward" and mode.name in detail
    assert level == logging.INFO


def _backend(**over):
    b = make_call().backend
    return SimpleNamespace(**{**vars(b), **over})


def _pool(dtype, store=None):
    return SimpleNamespace(dtype=dtype, store_dtype=store or dtype)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda: {"backend": _backend(use_mla=False)}, "not an MLA model"),
        (lambda: {"layer": make_layer(qk_head_dim=192, v_head_dim=128)}, "head dims 192/128"),
        (lambda: {"q": torch.zeros(T, H * 576, dtype=torch.float16)}, "q dtype torch.float16"),
        (lambda: {"backend": _backend(token_to_kv_pool=_pool(torch.float8_e4m3fn, torch.uint8))}, "fp8 KV cache"),
        (lambda: {"backend": _backend(token_to_kv_pool=_pool(torch.float16))}, "KV cache dtype"),
        (lambda: {"layer": make_layer(k_scale=torch.tensor(1.0))}, "scaled KV cache"),
        (lambda: {"layer": make_layer(sliding_window_size=4096)}, "sliding window"),
        (lambda: {"backend": _backend(use_sliding_window_kv_pool=True)}, "sliding-window KV pool"),
        (lambda: {"layer": make_layer(logit_cap=30.0)}, "logit cap"),
        (lambda: {"layer": make_layer(scaling=0.0)}, "softmax scale 0.0"),
        (lambda: {"layer": make_layer(scaling=-0.1)}, "softmax scale -0.1"),
        (lambda: {"sinks": torch.zeros(H)}, "sinks"),
        (lambda: {"score_mod": object()}, "score_mod"),
        (lambda: {"layer": make_layer(xai_temperature_len=1024)}, "xai temperature"),
        (lambda: {"backend": _backend(dcp_size=2)}, "dcp_size 2"),
        (lambda: {"layer": make_layer(attn_type=AttentionType.ENCODER_ONLY)}, "non-causal"),
        (lambda: {"layer": make_layer(is_cross_attention=True)}, "cross attention"),
        (lambda: {"backend": _backend(enable_deterministic=True)}, "deterministic"),
        (lambda: {"backend": _backend(dllm_attention=object())}, "diffusion-LM"),
        (lambda: {"backend": _backend(use_verify_splitkv=True)}, "split-KV verify"),
        (lambda: {"v": None}, "only one of k and v"),
        (lambda: {"k": torch.zeros(2 * T, 1, 576, dtype=torch.bfloat16),
                  "v": torch.zeros(2 * T, 1, 512, dtype=torch.bfloat16)}, "one-shot MHA"),
        (lambda: {"backend": _backend(forward_metadata=SimpleNamespace(**{**vars(make_call().metadata),
                                                                          "custom_mask": None}))},
         "custom_mask is None"),
        (lambda: {"layer": make_layer(tp_q_head_num=160)}, "160 query heads"),
        (lambda: {"backend": _backend(forward_metadata=SimpleNamespace(**{**vars(make_call().metadata),
                                                                          "max_extend_len": 129}))},
         "129 draft tokens"),
    ],
)
def test_unsupported_verify_calls_are_refused_with_a_reason(change, needle):
    ok, kind, level, detail = fallback.evaluate(make_call(**change()))
    assert not ok
    assert needle in f"{kind} {detail}"
    assert not any(ch.isdigit() for ch in kind.replace("576/512", "").replace("1..128", "").replace("fp8", "").replace("bfloat16", "")), \
        f"a kind is a counter key: no per-batch numbers ({kind!r})"
    assert level == (logging.INFO if needle == "not an MLA model" else logging.WARNING)


@pytest.mark.parametrize(("where", "name"), [("backend", "use_verify_splitkv"), ("backend", "dcp_size"),
                                             ("layer", "sliding_window_size"), ("metadata", "max_extend_len")])
def test_a_missing_attribute_refuses_the_call(where, name):
    """Fail closed: an attribute SGLang renamed is not read as "supported" through a default."""
    call = make_call()
    if where == "metadata":
        meta = SimpleNamespace(**vars(call.metadata))
        delattr(meta, name)
        call = make_call(backend=_backend(forward_metadata=meta))
    elif where == "backend":
        b = _backend()
        delattr(b, name)
        call = make_call(backend=b)
    else:
        layer = make_layer()
        delattr(layer, name)
        call = make_call(layer=layer)
    ok, kind, level, detail = fallback.evaluate(call)
    assert not ok and kind == fallback.PREDICATE_FAILED and level == logging.WARNING
    assert "AttributeError" in detail and name in detail


class _Recorder:
    """Wraps an object and records every attribute read."""

    def __init__(self, obj, seen, label):
        object.__setattr__(self, "_o", obj)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_label", label)

    def __getattr__(self, name):
        self._seen.add((self._label, name))
        return getattr(self._o, name)


def test_every_attribute_the_predicates_read_is_in_the_drift_list():
    """The drift check covers what the predicates read: run them on objects that record reads."""
    seen: set[tuple[str, str]] = set()
    base = make_call()
    backend = _backend(forward_metadata=_Recorder(base.metadata, seen, "ForwardMetadata"),
                       token_to_kv_pool=_Recorder(base.backend.token_to_kv_pool, seen, "MLATokenToKVPool"))
    call = make_call(backend=_Recorder(backend, seen, "TritonAttnBackend"),
                     layer=_Recorder(make_layer(), seen, "RadixAttention"),
                     forward_batch=_Recorder(base.forward_batch, seen, "ForwardBatch"))
    assert fallback.evaluate(call).ok
    listed = {(cls, n) for table in (fallback.REQUIRED, fallback.OPTIONAL) for (_, cls), names in table.items()
              for n in names}
    assert seen and seen <= listed, sorted(seen - listed)


def test_k_and_v_both_none_is_accepted():
    """SGLang then reads the drafts' latents back from the pool; the plugin does the same."""
    assert fallback.evaluate(make_call(k=None, v=None))[0]


def test_library_failure_is_reported_not_raised(monkeypatch, tmp_path):
    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "missing.so"))
    ok, reason, lib = fallback.library_status()
    assert not ok and lib is None
    assert "kernel library failed to load" in reason and "missing.so" in reason


@pytest.mark.parametrize(
    ("archs", "cap", "ok"),
    [("sm_90,sm_120", (9, 0), True), ("sm_90a", (9, 0), True), ("sm_120", (9, 0), False),
     ("sm_90,sm_120", (10, 0), False), ("sm_80,compute_90", (12, 0), True), ("", (9, 0), True)],
)
def test_device_support_follows_the_library_build_info(archs, cap, ok):
    got, kind, detail = fallback.device_supported(SimpleNamespace(archs=archs), cap)
    assert got is ok
    assert (kind == "") is ok
    if not ok:
        assert f"sm_{cap[0]}{cap[1]}" in detail


def test_the_predicates_read_attributes_the_real_triton_backend_sets():
    """Guard against SGLang renaming what the predicates read (they would then refuse every call)."""
    import inspect

    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    src = inspect.getsource(TritonAttnBackend)
    for name in ("use_mla", "token_to_kv_pool", "dcp_size", "forward_metadata", "enable_deterministic",
                 "use_verify_splitkv", "use_sliding_window_kv_pool"):
        assert f"self.{name} =" in src, name
    # a switch one end of the supported range lacks is OPTIONAL, read with its "path absent" value
    for name in ("use_verify_shared_kv", "use_dense_fp8_chunked_prefill", "dllm_attention"):
        assert f"self.{name} =" in src or name in fallback.OPTIONAL[
            ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend")], name


# --- the supported range: 0.5.17's objects lack what 0.5.23 added ---------------------------------


def _backend_0517(**over):
    """A backend shaped like SGLang 0.5.17's: no dllm_attention, use_verify_shared_kv or
    use_dense_fp8_chunked_prefill, and its unified-pool id translation (None on a plain pool)."""
    b = make_call().backend
    fields = {k: v for k, v in vars(b).items()
              if k not in ("dllm_attention", "use_verify_shared_kv", "use_dense_fp8_chunked_prefill")}
    meta = SimpleNamespace(**vars(b.forward_metadata), out_cache_loc_full_physical=None)
    return SimpleNamespace(**{**fields, "forward_metadata": meta, "_translate_kv_loc": None, **over})


def test_a_0517_backend_without_the_later_switches_is_accepted():
    assert fallback.evaluate(make_call(backend=_backend_0517())) == (True, "", logging.DEBUG, "")


@pytest.mark.parametrize("over", [{"_translate_kv_loc": lambda loc: loc}, {"forward_metadata": "unified"}])
def test_a_0517_unified_pool_with_virtual_slot_ids_is_refused(over):
    if over.get("forward_metadata") == "unified":
        meta = SimpleNamespace(**vars(_backend_0517().forward_metadata))
        meta.out_cache_loc_full_physical = torch.arange(T)
        over = {"forward_metadata": meta}
    ok, kind, level, _ = fallback.evaluate(make_call(backend=_backend_0517(**over)))
    assert not ok and kind == "unified (virtual slot id) KV pool not supported" and level == logging.WARNING


def test_the_optional_names_read_as_absent_paths_and_nothing_else():
    b = _backend_0517()
    assert fallback.optional(b, "dllm_attention") is None
    assert fallback.optional(b, "use_verify_shared_kv") is False
    assert fallback.optional(SimpleNamespace(use_verify_shared_kv=True), "use_verify_shared_kv") is True
    with pytest.raises(KeyError):
        fallback.optional(b, "use_mla_v2")  # not an optional name: no default is made up


@pytest.mark.parametrize(("version", "inside"), [("0.5.17", True), ("0.5.20", True), ("0.5.23", True),
                                                 ("0.5.16", False), ("0.5.24", False), ("0.6.0", False),
                                                 ("0.5.23.post1", False), (None, False), ("dev", False)])
def test_the_supported_range(version, inside):
    assert fallback.in_supported_range(version) is inside


def test_outside_the_range_the_optional_names_are_required():
    """A release nobody has read may lack a switch for a path it has: then nothing is hooked."""
    from kdtree_engine.sglang import drift

    inside, outside = drift.required_for("0.5.17"), drift.required_for("0.6.0")
    tb = ("sglang.srt.layers.attention.triton_backend", "TritonAttnBackend")
    assert "use_verify_shared_kv" not in inside[tb] and "use_verify_shared_kv" in outside[tb]
    assert set(outside[tb]) == set(fallback.REQUIRED[tb]) | set(fallback.OPTIONAL[tb])
    # each end lacks some optional name (0.5.23 the unified-pool translation, 0.5.17 the later
    # switches): read as an unknown release, neither would be hooked
    lacking = [f"{module}.{cls}.{n}" for (module, cls), names in fallback.OPTIONAL.items()
               for n in names if n not in drift.known_names(getattr(__import__(module, fromlist=[cls]), cls))]
    assert lacking and drift.check(outside) == lacking
