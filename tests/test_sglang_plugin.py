"""The SGLang plugin against the real SGLang package on CPU: entry point, switch, hook, routing."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.sglang import plugin
from kdtree_pipeline.testing import standins as _standins

_standins.install_torchvision_standin()  # CPU torch cannot load the CUDA torchvision wheels
if torch.cuda.is_available():  # on CUDA, SGLang's module imports need sgl_kernel (absent on the GPU host)
    _standins.install_sgl_kernel_standin()

import sglang.srt.plugins as sglang_plugins  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

pytestmark = pytest.mark.sglang

# Kept in a dict: HookRegistry rebinds every *module attribute* that holds the original function.
_SAVED = {"forward_extend": TritonAttnBackend.__dict__["forward_extend"]}
FAKE_LIB = SimpleNamespace(path="/fake/libkdtree_verify.so", archs="sm_90,sm_120")


@pytest.fixture
def clean(monkeypatch):
    """Fresh plugin/hook state; the real class restored afterwards."""
    saved_hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    saved_patched = set(HookRegistry._patched)
    HookRegistry.reset()
    monkeypatch.setattr(sglang_plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin._runtime.reset()
    yield
    TritonAttnBackend.forward_extend = _SAVED["forward_extend"]
    HookRegistry.reset()
    HookRegistry._hooks.update(saved_hooks)
    HookRegistry._patched.update(saved_patched)
    plugin._runtime.reset()


@pytest.fixture
def fake_library(monkeypatch):
    """The kernel library as if built (CI's CPU box may have none)."""
    monkeypatch.setattr(plugin.fallback, "library_status", lambda: (True, "", FAKE_LIB))


def hooked() -> bool:
    f, original = TritonAttnBackend.__dict__["forward_extend"], _SAVED["forward_extend"]
    return f is not original and getattr(f, "__wrapped__", None) is original


# --- entry point and switch ---------------------------------------------------------------


def test_entry_point_is_discoverable_in_sglangs_group():
    eps = [ep for ep in importlib.metadata.entry_points(group=sglang_plugins.GENERAL_PLUGINS_GROUP)
           if ep.name == "kdtree_verify"]
    assert len(eps) == 1, "pip install -e . (the pyproject declares the entry point)"
    assert eps[0].value == "kdtree_engine.sglang.plugin:load"
    assert eps[0].load() is plugin.load


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("off", False), ("OFF", False),
                                           ("on", True), (" On ", True)])
def test_read_switch(value, on):
    assert plugin.read_switch({} if value is None else {plugin.ENV: value}) is on


@pytest.mark.parametrize("value", ["1", "true", "yes", "onn", "kdtree"])
def test_invalid_switch_names_the_variable_and_value(value):
    with pytest.raises(plugin.KdtreeConfigError) as e:
        plugin.read_switch({plugin.ENV: value})
    assert "KDTREE_VERIFY" in str(e.value) and repr(value) in str(e.value) and "'on' or 'off'" in str(e.value)


def test_load_plugins_with_on_hooks_the_real_method(clean, fake_library, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV, "on")
    with caplog.at_level(logging.INFO):
        sglang_plugins.load_plugins()
    assert hooked()
    target = HookRegistry._hooks[plugin.TARGET]
    assert [(t, h) for t, h, _ in target] == [(HookType.AROUND, plugin.verify_hook)]
    assert plugin.TARGET in HookRegistry._patched
    assert plugin.status()["enabled"] is True
    assert re.search(r"kdtree verify \[pid \d+\]: hook registered on TritonAttnBackend.forward_extend", caplog.text)


@pytest.mark.parametrize("value", [None, "off"])
def test_load_plugins_with_off_or_unset_registers_nothing(clean, fake_library, monkeypatch, caplog, value):
    if value is not None:
        monkeypatch.setenv(plugin.ENV, value)
    with caplog.at_level(logging.INFO):
        sglang_plugins.load_plugins()
    assert not hooked()
    assert plugin.TARGET not in HookRegistry._hooks
    assert plugin.status()["enabled"] is False
    assert "kdtree verify: off: KDTREE_VERIFY" in caplog.text


LOAD_BEFORE_LOGGING = """
import logging, sys
from types import SimpleNamespace
from kdtree_pipeline.testing import standins
standins.install_torchvision_standin()
from kdtree_engine.sglang import fallback, plugin
fallback.library_status = lambda: (True, "", SimpleNamespace(path="/fake/lib.so", archs="sm_90a"))
from sglang.srt.plugins import load_plugins
load_plugins()  # as launch_server and each scheduler process do: before SGLang configures logging
print("after load:", plugin.logger.handlers, plugin.logger.level)
logging.basicConfig(level=logging.INFO, format="[configured] %(message)s", force=True)
plugin.logger.info("kdtree verify: a later line")
"""


@pytest.mark.parametrize(("value", "line"), [
    ("on", "kdtree verify [pid {pid}]: hook registered on TritonAttnBackend.forward_extend (KDTREE_VERIFY=on"),
    ("off", "kdtree verify: off: KDTREE_VERIFY=off"),
])
def test_load_lines_reach_the_log_before_sglang_configures_logging(tmp_path, value, line):
    """SGLang loads plugins before its configure_logger (root logger: no handler, WARNING), so
    an INFO line of load() would be dropped and the server's log would not say what the plugin
    decided. Through SGLang's own load_plugins in a fresh process: the decision line is on
    stderr once, the plugin's logger is left as it was, and a later line goes through the
    configured root handler only (not printed twice)."""
    env = {**os.environ, plugin.ENV: value}
    env.pop("SGLANG_PLUGINS", None)
    p = subprocess.run([sys.executable, "-c", LOAD_BEFORE_LOGGING], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    pid_free = re.sub(r"\[pid \d+\]", "[pid {pid}]", p.stderr)
    assert pid_free.count(line) == 1, p.stderr[-2000:]
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] kdtree verify", p.stderr, re.M)
    assert "after load: [] 0" in p.stdout
    assert p.stderr.count("kdtree verify: a later line") == 1
    assert "[configured] kdtree verify: a later line" in p.stderr


def test_invalid_value_is_an_error_at_plugin_load(clean, fake_library, monkeypatch):
    monkeypatch.setenv(plugin.ENV, "maybe")
    with pytest.raises(plugin.KdtreeConfigExit, match="KDTREE_VERIFY='maybe'"):
        plugin.load()
    # SGLang's loader catches Exception from a plugin; a SystemExit goes through it
    with pytest.raises(SystemExit, match="KDTREE_VERIFY='maybe' is not valid"):
        sglang_plugins.load_plugins()
    assert not hooked()


def test_a_typo_in_the_switch_stops_the_process_through_sglangs_loader(tmp_path):
    """SGLang's real load_plugins in a fresh process with KDTREE_VERIFY=bogus ends
    it with exit status 1 and a message naming the variable and the value."""
    import os
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(plugin.__file__).rsplit('/kdtree_engine/', 1)[0]!r})\n"
            "from kdtree_pipeline.testing import standins\n"
            "standins.install_torchvision_standin()\n"  # 0.5.17's sglang package imports torchvision
            "from sglang.srt.plugins import load_plugins\n"
            "load_plugins()\n"
            "print('still serving')\n")
    env = {**os.environ, plugin.ENV: "bogus"}
    env.pop("SGLANG_PLUGINS", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "still serving" not in r.stdout
    assert "KDTREE_VERIFY='bogus' is not valid: expected 'on' or 'off'" in r.stderr
    assert "Failed to execute general plugin" not in r.stderr


def test_missing_kernel_library_keeps_sglangs_path(clean, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(plugin.ENV, "on")
    monkeypatch.setenv("KDTREE_LIB", str(tmp_path / "nope.so"))
    with caplog.at_level(logging.INFO):
        sglang_plugins.load_plugins()
    assert not hooked()
    assert re.search(r"kdtree verify \[pid \d+\]: off: kernel library failed to load", caplog.text)
    assert plugin.status()["enabled"] is False


# --- signature check ---------------------------------------------------------------------------


def test_real_forward_extend_has_the_expected_signature():
    assert plugin.check_signature(_SAVED["forward_extend"]) == (True, "")


def _changed(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None, score_mod=None,
             aux_tensors=None, new_flag=False):
    raise AssertionError("never called")


def _renamed(self, q, k, v, layer, batch, save_kv_cache=True, sinks=None, score_mod=None, aux_tensors=None):
    raise AssertionError("never called")


@pytest.mark.parametrize(("func", "needle"), [(_changed, "new_flag=False"), (_renamed, "batch")])
def test_changed_signature_is_refused(func, needle):
    ok, reason = plugin.check_signature(func)
    assert not ok and needle in reason and "not hooking" in reason


def test_changed_signature_fails_loudly_and_does_not_hook(clean, fake_library, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV, "on")
    monkeypatch.setattr(TritonAttnBackend, "forward_extend", _changed)
    with caplog.at_level(logging.INFO):
        sglang_plugins.load_plugins()
    assert TritonAttnBackend.__dict__["forward_extend"] is _changed  # untouched
    assert plugin.TARGET not in HookRegistry._hooks
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "kdtree_engine.sglang"]
    assert errors and "new_flag" in errors[0].getMessage()


def test_missing_method_fails_loudly(clean, fake_library, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV, "on")
    monkeypatch.delattr(TritonAttnBackend, "forward_extend")
    with caplog.at_level(logging.ERROR):
        plugin.load()
    assert "has no TritonAttnBackend.forward_extend" in caplog.text
    assert plugin.TARGET not in HookRegistry._hooks


# --- routing ------------------------------------------------------------------------------------

H, N, BS = 16, 4, 2
T = N * BS


class Original:
    """Stands for SGLang's forward_extend: records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, backend, *args, **kwargs):
        self.calls.append((backend, args, kwargs))
        return "sglang-result"


class FakeBackend:
    """The attributes and the save path of SGLang's TritonAttnBackend (its real _set_kv_buffer)."""

    _set_kv_buffer = TritonAttnBackend._set_kv_buffer

    def __init__(self, pool, metadata):
        self.use_mla, self.dcp_size, self.token_to_kv_pool, self.forward_metadata = True, 1, pool, metadata
        self.dllm_attention, self.enable_deterministic = None, False
        self.use_verify_shared_kv = self.use_verify_splitkv = self.use_dense_fp8_chunked_prefill = False
        self.use_sliding_window_kv_pool = False


def make_verify(mode=ForwardMode.TARGET_VERIFY, qo_dtype=torch.int64):
    pool = MLATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    prefix = (5, 3)
    meta = SimpleNamespace(
        qo_indptr=torch.arange(0, (BS + 1) * N, N, dtype=qo_dtype),  # CUDA-graph buffers are int64
        kv_indptr=torch.tensor([0, 5, 8], dtype=torch.int32), kv_indices=torch.arange(10, 18),
        custom_mask=torch.ones(sum(N * (p + N) for p in prefix), dtype=torch.uint8),
        mask_indptr=torch.tensor([0, N * (5 + N), N * (5 + N) + N * (3 + N)], dtype=torch.int32),
        max_extend_len=N, swa_out_cache_loc=None)
    fb = SimpleNamespace(forward_mode=mode, out_cache_loc=torch.tensor([40, 33, 47, 41, 52, 60, 35, 44]),
                         out_cache_loc_is_physical=False, seq_lens_cpu=torch.tensor(prefix, dtype=torch.int32))
    layer = RadixAttention(num_heads=H, head_dim=576, scaling=576**-0.5, num_kv_heads=1, layer_id=0, v_head_dim=512)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H * 576, generator=g).to(torch.bfloat16)
    k = torch.randn(T, 1, 576, generator=g).to(torch.bfloat16)
    return FakeBackend(pool, meta), q, k, k[..., :512], layer, fb


@pytest.fixture
def runtime_on(monkeypatch, fake_library):
    """The plugin as on a GPU, minus the device: prepare()'s VerifyArgs goes through the real
    plugin._launch, op.verify and check_arguments (with the CUDA-device check off, the only
    one a CPU cannot pass); the launch itself records the call's arguments (and the longest
    prefix the checks took from the hint) and fills out."""
    from dataclasses import fields

    from kdtree_engine.kernel import op

    plugin._runtime.reset()
    monkeypatch.setattr(plugin._runtime, "device_ok", lambda device: (True, ""))
    real_check = op.check_arguments
    monkeypatch.setattr(op, "check_arguments", lambda *a, **kw: real_check(*a, **{**kw, "require_cuda": False}))
    launched = []

    def run(a, shapes):
        launched.append({**{f.name: getattr(a, f.name) for f in fields(a)}, "max_prefix_len": shapes.max_prefix_len})
        a.out.fill_(1.5)

    monkeypatch.setattr(op, "_run", run)
    with get_parallel().override(dcp_enabled=False, tp_rank=3):
        yield launched
    plugin._runtime.reset()


def test_non_verify_calls_go_to_the_original_unchanged(runtime_on):
    backend, q, k, v, layer, fb = make_verify(mode=ForwardMode.EXTEND)
    orig = Original()
    got = plugin.verify_hook(orig, backend, q, k, v, layer, fb, save_kv_cache=True, sinks=None)
    assert got == "sglang-result"
    (b, args, kwargs), = orig.calls
    assert b is backend and args[0] is q and args[3] is layer and kwargs == {"save_kv_cache": True, "sinks": None}
    assert runtime_on == []
    assert plugin.status()["fallbacks"] == {"not a TARGET_VERIFY forward": 1}
    assert plugin.status()["verify_fallbacks"] == 0  # a prefill call is out of scope, not a verify fallback


def test_unexpected_arguments_go_to_the_original(runtime_on):
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    assert plugin.verify_hook(orig, backend, q, k, v, layer, fb, bogus=1) == "sglang-result"
    assert orig.calls[0][2] == {"bogus": 1} and runtime_on == []


def test_verify_call_saves_kv_like_sglang_and_returns_sglangs_output_layout(runtime_on):
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    o = plugin.verify_hook(orig, backend, q, k, v, layer, fb)
    assert orig.calls == []
    assert isinstance(o, torch.Tensor) and o.shape == (T, H * 512) and o.dtype == torch.bfloat16
    assert torch.all(o == 1.5)  # what the (stubbed) kernel wrote into SGLang's output tensor
    pool = backend.token_to_kv_pool.get_key_buffer(0)
    assert torch.equal(pool[fb.out_cache_loc], k)  # saved by SGLang's own _set_kv_buffer
    (a,) = runtime_on
    assert a["q"].shape == (T, H, 576) and a["q"].data_ptr() == q.data_ptr()
    assert a["out"].data_ptr() == o.data_ptr() and a["out"].shape == (T, H, 512)
    assert a["kv_buffer"] is pool
    # SGLang's own indptr buffers go to the kernel as they are: no int64 -> int32 conversion launch
    assert a["qo_indptr"] is backend.forward_metadata.qo_indptr and a["qo_indptr"].dtype == torch.int64
    assert a["kv_indptr"] is backend.forward_metadata.kv_indptr and a["kv_indptr"].dtype == torch.int32
    assert a["k_ext"].shape == (T, 1, 576) and a["draft_slots"] is None
    assert a["mask_indptr"].dtype == torch.int64 and a["kv_indices"] is backend.forward_metadata.kv_indices
    assert a["custom_mask"] is backend.forward_metadata.custom_mask
    assert a["max_n"] == N and a["sm_scale"] == pytest.approx(576**-0.5)
    assert a["max_prefix_len"] == 5  # from SGLang's seq_lens_cpu hint
    assert plugin.status()["kernel_calls"] == 1


class _Meta(SimpleNamespace):
    """A forward_metadata that takes weak references, as SGLang's ForwardMetadata dataclass does."""


def test_sglangs_forward_metadata_takes_weak_references():
    """The plugin keys a step's plan on the step's forward_metadata by weak reference."""
    from sglang.srt.layers.attention.triton_backend import ForwardMetadata

    assert ForwardMetadata.__weakrefoffset__ != 0


def test_the_first_call_of_a_step_makes_the_plan_and_the_other_layers_read_it(runtime_on, monkeypatch):
    """One plan per backend; a new forward_metadata (SGLang builds one per step) makes it again."""
    from kdtree_engine.kernel import op

    made = []

    class FakePlan:
        def __init__(self, device):
            self.device = torch.device(device)
            made.append(self)

    monkeypatch.setattr(op, "VerifyPlan", FakePlan)
    monkeypatch.setattr(plugin.fallback, "library_status",
                        lambda: (True, "", SimpleNamespace(**vars(FAKE_LIB), has_plan=True)))
    plugin._runtime.reset()
    monkeypatch.setattr(plugin._runtime, "device_ok", lambda device: (True, ""))
    backend, q, k, v, layer, fb = make_verify()
    backend.forward_metadata = _Meta(**vars(backend.forward_metadata))
    for _ in range(3):  # three layers of one step
        plugin.verify_hook(Original(), backend, q, k, v, layer, fb)
    backend.forward_metadata = _Meta(**vars(backend.forward_metadata))  # the next step
    plugin.verify_hook(Original(), backend, q, k, v, layer, fb)
    plugin.verify_hook(Original(), backend, q, k, v, layer, fb)
    assert [a["make_plan"] for a in runtime_on] == [True, False, False, True, False]
    assert len(made) == 1 and all(a["plan"] is made[0] for a in runtime_on)
    assert plugin.status()["plan_calls"] == {"made": 2, "read": 3}


def test_no_plan_without_a_plan_library_or_a_weakly_referenced_step(runtime_on, monkeypatch):
    """A library of an older ABI, or a metadata object without weak references: the kernel
    derives its schedule in every call (no plan, nothing refused)."""
    backend, q, k, v, layer, fb = make_verify()  # FAKE_LIB has no has_plan
    plugin.verify_hook(Original(), backend, q, k, v, layer, fb)
    monkeypatch.setattr(plugin.fallback, "library_status",
                        lambda: (True, "", SimpleNamespace(**vars(FAKE_LIB), has_plan=True)))
    plugin._runtime.reset()
    monkeypatch.setattr(plugin._runtime, "device_ok", lambda device: (True, ""))
    plugin.verify_hook(Original(), backend, q, k, v, layer, fb)  # SimpleNamespace metadata: no weakref
    assert [(a["plan"], a["make_plan"]) for a in runtime_on] == [(None, False), (None, False)]
    assert plugin.status()["kernel_calls"] == 1 and plugin.status()["fallbacks"] == {}
    assert plugin.status()["plan_calls"] == {"made": 0, "read": 0}


def test_a_batch_the_checks_refuse_falls_back_after_the_kv_write(runtime_on):
    """prepare()'s VerifyArgs goes through check_arguments: a mask shorter than the prefix
    lengths need is refused there, and SGLang's path serves it without writing the KV again."""
    backend, q, k, v, layer, fb = make_verify()
    backend.forward_metadata.custom_mask = backend.forward_metadata.custom_mask[:-1]
    orig = Original()
    assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert runtime_on == [] and orig.calls[0][2]["save_kv_cache"] is False
    assert torch.equal(backend.token_to_kv_pool.get_key_buffer(0)[fb.out_cache_loc], k)
    assert plugin.status()["fallbacks"] == {plugin.K_REFUSED: 1}


def test_attn_output_buffer_is_honoured(runtime_on):
    backend, q, k, v, layer, fb = make_verify()
    fb._attn_output = torch.zeros(T, H * 512, dtype=torch.bfloat16)
    o = plugin.verify_hook(Original(), backend, q, k, v, layer, fb)
    assert o is fb._attn_output and torch.all(o == 1.5)


def test_k_none_reads_the_drafts_back_from_the_pool(runtime_on):
    """k None: SGLang already wrote the drafts' latents at out_cache_loc. The kernel reads
    them there by slot id: no gather of the pool on the host side, no copy."""
    backend, q, k, v, layer, fb = make_verify()
    pool = backend.token_to_kv_pool.get_key_buffer(0)
    pool[fb.out_cache_loc] = k
    plugin.verify_hook(Original(), backend, q, None, None, layer, fb, save_kv_cache=False)
    (a,) = runtime_on
    assert a["k_ext"] is None and a["draft_slots"] is fb.out_cache_loc
    assert torch.equal(a["kv_buffer"][a["draft_slots"]], k)


def test_kernel_refusing_a_batch_falls_back_with_a_warning(runtime_on, monkeypatch, caplog):
    from kdtree_engine.kernel.op import VerifyArgumentError

    def refuse(a):
        raise VerifyArgumentError("verify_attention: argument 'kv_buffer': expected X, got Y")

    monkeypatch.setattr(plugin, "_launch", refuse)
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    with caplog.at_level(logging.WARNING):
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert len(orig.calls) == 2 and all(c[2]["save_kv_cache"] is False for c in orig.calls)  # KV already saved
    assert torch.equal(backend.token_to_kv_pool.get_key_buffer(0)[fb.out_cache_loc], k)
    assert caplog.text.count("kernel refused the batch") == 1  # once per distinct reason
    assert plugin.status()["disabled_reason"] is None


def test_kernel_failure_switches_the_kernel_off_for_the_process(runtime_on, monkeypatch, caplog):
    def boom(a):
        raise RuntimeError("kdtree verify kernel failed (code 3): no kernel image for this device")

    monkeypatch.setattr(plugin, "_launch", boom)
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    with caplog.at_level(logging.WARNING):
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    monkeypatch.setattr(plugin, "_launch", lambda a: pytest.fail("kernel called after it was switched off"))
    assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert "no kernel image" in plugin.status()["disabled_reason"]
    assert "kdtree verify [tp 3]: off: kernel failed" in caplog.text


def test_unsupported_verify_batch_goes_to_the_original(runtime_on, caplog):
    backend, q, k, v, layer, fb = make_verify()
    backend.forward_metadata.max_extend_len = 200
    orig = Original()
    with caplog.at_level(logging.WARNING):
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert runtime_on == [] and "draft tokens per request not supported (1..128) (200 draft tokens" in caplog.text
    assert "[tp 3]" in caplog.text


def test_library_missing_at_runtime_falls_back(monkeypatch, caplog):
    plugin._runtime.reset()
    monkeypatch.setattr(plugin.fallback, "library_status", lambda: (False, "kernel library failed to load: x", None))
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    with caplog.at_level(logging.WARNING):
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert "kernel library failed to load" in caplog.text
    plugin._runtime.reset()


# --- drift, fail-closed KV write, bounded logging -------------------------------------------------


def test_drift_check_passes_on_this_sglang_and_names_what_is_missing():
    from kdtree_engine.sglang import drift

    assert drift.check() == []
    module = "sglang.srt.mem_cache.memory_pool"
    assert drift.check({(module, "KVWriteLoc"): ("loc", "loc_v2")}) == [f"{module}.KVWriteLoc.loc_v2"]
    got = drift.check({("sglang.srt.layers.attention.triton_backend", "TritonAttnBackendV2"): ("use_mla",)})
    assert len(got) == 1 and "TritonAttnBackendV2" in got[0]


def _rename(monkeypatch, cls, old, new):
    monkeypatch.setattr(cls, new, cls.__dict__[old], raising=False)
    monkeypatch.delattr(cls, old)


_HAS_FOR_BATCH = hasattr(__import__("sglang.srt.mem_cache.memory_pool", fromlist=["KVWriteLoc"]).KVWriteLoc,
                         "for_batch")
needs_for_batch = pytest.mark.skipif(not _HAS_FOR_BATCH, reason="this SGLang (0.5.17) builds its KV write "
                                     "location without KVWriteLoc.for_batch; nothing to rename")


@needs_for_batch
def test_a_renamed_sglang_method_means_no_hook_at_registration(clean, fake_library, monkeypatch, caplog):
    """SGLang renames KVWriteLoc.for_batch (save_kv calls it): the plugin does not hook and
    says which one is missing."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    monkeypatch.setenv(plugin.ENV, "on")
    _rename(monkeypatch, KVWriteLoc, "for_batch", "for_batch_v2")
    with caplog.at_level(logging.INFO):
        sglang_plugins.load_plugins()
    assert not hooked() and plugin.TARGET not in HookRegistry._hooks
    assert plugin.status()["enabled"] is False
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR and r.name == "kdtree_engine.sglang"]
    assert len(errors) == 1 and "sglang.srt.mem_cache.memory_pool.KVWriteLoc.for_batch" in errors[0]
    assert "not hooking" in errors[0]


def test_a_renamed_set_kv_buffer_means_no_hook(clean, fake_library, monkeypatch, caplog):
    monkeypatch.setenv(plugin.ENV, "on")
    _rename(monkeypatch, TritonAttnBackend, "_set_kv_buffer", "_set_kv_buffer_v2")
    with caplog.at_level(logging.ERROR):
        sglang_plugins.load_plugins()
    assert not hooked() and "TritonAttnBackend._set_kv_buffer" in caplog.text


@needs_for_batch
def test_the_same_rename_at_run_time_sends_the_batch_to_sglangs_path_with_save(runtime_on, monkeypatch, caplog):
    """Hooked, then KVWriteLoc.for_batch goes missing: the KV write fails inside the fallback,
    SGLang's own forward_extend gets the call with save_kv_cache=True (it writes the KV), the
    plugin wrote nothing, and the kernel never ran."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    _rename(monkeypatch, KVWriteLoc, "for_batch", "for_batch_v2")
    backend, q, k, v, layer, fb = make_verify()
    before = backend.token_to_kv_pool.get_key_buffer(0).clone()
    orig = Original()
    with caplog.at_level(logging.WARNING):
        assert plugin.verify_hook(orig, backend, q, k, v, layer, fb, save_kv_cache=True) == "sglang-result"
    (b, args, kwargs), = orig.calls
    assert kwargs == {"save_kv_cache": True} and args[1] is k  # the call as SGLang made it
    assert torch.equal(backend.token_to_kv_pool.get_key_buffer(0), before)  # not written by the plugin
    assert runtime_on == []
    assert plugin.status()["fallbacks"] == {plugin.K_KV_WRITE: 1}
    assert "[tp 3]" in caplog.text and "AttributeError" in caplog.text


def test_a_failing_kv_write_is_not_retried_by_the_plugin(runtime_on, monkeypatch):
    calls = []

    def broken(self, forward_batch, layer, loc_info, k, v, k_scale=None, v_scale=None):
        calls.append(1)
        raise RuntimeError("pool changed")

    monkeypatch.setattr(FakeBackend, "_set_kv_buffer", broken)
    backend, q, k, v, layer, fb = make_verify()
    orig = Original()
    assert plugin.verify_hook(orig, backend, q, k, v, layer, fb) == "sglang-result"
    assert calls == [1] and len(orig.calls) == 1 and orig.calls[0][2] == {}  # save_kv_cache default True
    assert runtime_on == []


def test_many_distinct_bad_batches_log_once_per_kind_and_stay_bounded(runtime_on, monkeypatch, caplog):
    """2000 batches, each refused with its own numbers (drafts per request,
    kernel messages): one line per kind, the counters keyed by kind only."""
    from kdtree_engine.kernel.op import VerifyArgumentError

    orig = Original()
    with caplog.at_level(logging.INFO, logger="kdtree_engine.sglang"):
        for i in range(1000):
            backend, q, k, v, layer, fb = make_verify()
            backend.forward_metadata.max_extend_len = 129 + i
            plugin.verify_hook(orig, backend, q, k, v, layer, fb)

        counter = iter(range(10**6))

        def refuse(a):
            raise VerifyArgumentError(f"verify_attention: argument 'kv_indices': expected {next(counter)} slot ids")

        monkeypatch.setattr(plugin, "_launch", refuse)
        for _ in range(1000):
            backend, q, k, v, layer, fb = make_verify()
            plugin.verify_hook(orig, backend, q, k, v, layer, fb)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) == 2 and all(line.startswith("kdtree verify [tp 3]:") for line in lines)
    assert "(129 draft tokens per request)" in lines[0] and "expected 0 slot ids" in lines[1]
    st = plugin.status()
    assert st["fallbacks"] == {"draft tokens per request not supported (1..128)": 1000, plugin.K_REFUSED: 1000}
    assert st["verify_fallbacks"] == 2000
    assert len(plugin._runtime.logged) == 2 and len(orig.calls) == 2000


def test_kernel_calls_are_logged_at_powers_of_two(caplog):
    """A server's log says what the kernel served without a line per call: the counts at
    1, 2, 4, 8, ... calls, with the verify calls SGLang's path took."""
    r = plugin._Runtime()
    r.note("k ext refused", logging.WARNING)
    with caplog.at_level(logging.INFO, logger="kdtree_engine.sglang"):
        for i in range(9):
            r.count_kernel_call(plan=object(), make_plan=i % 4 == 0)
    lines = [m.getMessage() for m in caplog.records if "kernel calls" in m.getMessage()]
    assert [int(line.split(": ")[1].split()[0]) for line in lines] == [1, 2, 4, 8]
    assert lines[-1].endswith("8 kernel calls (step plan made 2, read 6), 1 verify calls on SGLang's path")


def test_fallback_kinds_are_capped(monkeypatch):
    r = plugin._Runtime()
    for i in range(500):
        r.note(f"kind {i}", logging.DEBUG)
    assert len(r.fallbacks) == plugin.MAX_KINDS + 1 and r.fallbacks[plugin.OTHER_KIND] == 500 - plugin.MAX_KINDS
    assert len(r.logged) == plugin.MAX_KINDS + 1


def test_the_write_location_of_a_0517_release_is_the_plain_one(monkeypatch):
    """0.5.17's KVWriteLoc has no physical mark and no for_batch; its forward_extend builds
    KVWriteLoc(out_cache_loc, swa_out_cache_loc, full_loc=out_cache_loc_full_physical)."""
    import dataclasses

    import sglang.srt.mem_cache.memory_pool as mp

    @dataclasses.dataclass
    class KVWriteLoc0517:
        loc: torch.Tensor
        swa_loc: torch.Tensor | None = None
        full_loc: torch.Tensor | None = None

    monkeypatch.setattr(mp, "KVWriteLoc", KVWriteLoc0517)
    backend, q, k, v, layer, fb = make_verify()
    backend.forward_metadata.out_cache_loc_full_physical = None
    loc = plugin.write_loc(plugin.VerifyCall(backend=backend, q=q, k=k, v=v, layer=layer, forward_batch=fb))
    assert isinstance(loc, KVWriteLoc0517) and loc.loc is fb.out_cache_loc and loc.full_loc is None

    from kdtree_engine.sglang import drift

    assert drift.check({}) == []  # the plain spelling fits: loc, swa_loc, full_loc and no physical mark

    @dataclasses.dataclass
    class MarkedWithoutForBatch(KVWriteLoc0517):
        physical: bool = False

    monkeypatch.setattr(mp, "KVWriteLoc", MarkedWithoutForBatch)
    assert drift.check({}) == ["sglang.srt.mem_cache.memory_pool.KVWriteLoc.for_batch"]
