"""The op as a server uses it: per-stream workspaces, fake tensors, torch.compile, CUDA graphs.

CPU: the workspace keying (with an allocator that makes CPU buffers), the checks on
fake and meta tensors, ``torch.library.opcheck`` and a full-graph dynamo trace over
fake CUDA tensors. GPU (marked ``gpu``): two streams at once against serial calls,
and a compiled function against eager, also replayed from a CUDA graph.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kdtree_engine.kernel import op
from kdtree_pipeline.oracle import workloads


def _cpu_workspaces(allocs: list[tuple[int, int]]) -> op._Workspaces:
    def alloc(idx: int, nbytes: int) -> torch.Tensor:
        allocs.append((idx, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    return op._Workspaces(alloc)


def test_workspaces_are_per_device_and_stream_and_never_freed():
    allocs: list[tuple[int, int]] = []
    ws = _cpu_workspaces(allocs)
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = ws.get(dev0, 100, stream=7)
    assert ws.get(dev0, 50, stream=7) is a  # same stream: the same buffer
    b = ws.get(dev0, 100, stream=9)
    c = ws.get(dev1, 100, stream=7)  # same handle value on another device: another buffer
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert allocs == [(0, 1 << 20), (0, 1 << 20), (1, 1 << 20)]
    grown = ws.get(dev0, (1 << 20) + 1, stream=7)  # growth doubles and replaces for later calls ...
    assert grown is not a and grown.numel() == 2 << 20 and ws.get(dev0, 10, stream=7) is grown
    assert ws.get(dev0, 10, stream=9) is b  # ... on that stream only
    assert any(t is a for t in ws._keep)  # ... and keeps the old one (a captured graph may hold it)


def test_workspace_key_is_the_current_stream(monkeypatch):
    """Without an explicit stream, the current stream of the device picks the workspace."""
    current = {0: SimpleNamespace(cuda_stream=11)}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda idx=None: current[idx])
    ws = _cpu_workspaces([])
    first = ws.get(torch.device("cuda", 0), 10)
    current[0] = SimpleNamespace(cuda_stream=12)
    second = ws.get(torch.device("cuda", 0), 10)
    current[0] = SimpleNamespace(cuda_stream=11)
    assert second is not first and ws.get(torch.device("cuda", 0), 10) is first


def test_workspaces_from_many_threads_get_one_buffer_per_stream():
    allocs: list[tuple[int, int]] = []
    ws = _cpu_workspaces(allocs)
    got: dict[int, set[int]] = {s: set() for s in range(4)}
    lock = threading.Lock()

    def worker(stream: int) -> None:
        for _ in range(200):
            t = ws.get(torch.device("cuda", 0), 64, stream=stream)
            with lock:
                got[stream].add(t.data_ptr())

    threads = [threading.Thread(target=worker, args=(s % 4,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(v) == 1 for v in got.values()) and len(allocs) == 4


def _batch(device="cpu"):
    return workloads.make_batch([5, 0, 9], [4, 2, 3], 2, seed=0, spare_slots=4, device=device)


def test_checks_run_on_fake_tensors():
    """torch.compile traces with fake tensors, which have no data_ptr() or storage address."""
    b = _batch()
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) for t in b.kernel_args()[:8]]
    with mode:
        out = torch.empty((9, 2, 512), dtype=torch.bfloat16)
        shapes = op.check_arguments(op.VerifyArgs(*fake, b.sm_scale, b.max_n, out=out), require_cuda=False)
        assert (shapes.bs, shapes.total_tokens, shapes.num_heads) == (3, 9, 2)
        with pytest.raises(op.VerifyArgumentError, match="'k_ext': expected 9 rows"):
            op.check_arguments(op.VerifyArgs(fake[0], fake[1][:8], *fake[2:], b.sm_scale, b.max_n), require_cuda=False)


def _meta_op_args(b):
    meta = [t.to("meta") for t in b.kernel_args()[:8]]
    T, H = b.q.shape[0], b.q.shape[1]
    out = torch.empty((T, H, 512), dtype=torch.bfloat16, device="meta")
    lse = torch.empty((T, H), dtype=torch.float32, device="meta")
    return (*meta, out, lse, None, float(b.sm_scale), b.max_n, 0, -1)


def test_opcheck_passes_with_fake_tensors():
    result = torch.library.opcheck(torch.ops.kdtree.verify_attention.default, _meta_op_args(_batch()))
    assert result == {k: "SUCCESS" for k in result} and "test_faketensor" in result
    assert "test_aot_dispatch_dynamic" in result


def test_a_compiled_caller_traces_to_one_op_without_graph_breaks():
    """fullgraph=True fails on any graph break: the checks, the output allocation and the op
    all trace; no library call (ctypes) happens while tracing."""
    b = _batch()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(q, k_ext, kv, qo, kvp, kvi, mask, mi):
        return op.verify_attention(q, k_ext, kv, qo, kvp, kvi, mask, mi, b.sm_scale, b.max_n) * 2

    with FakeTensorMode():
        fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") for t in b.kernel_args()[:8]]
        got = torch.compile(fn, backend=backend, fullgraph=True)(*fake)
        assert got.shape == (9, 2, 512) and got.device.type == "cuda"
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "kdtree" in str(n.target)]
    assert len(calls) == 1 and str(calls[0].target).startswith("kdtree.verify_attention")


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_two_streams_at_once_equal_serial_calls():
    """30 rounds of two different batches verified at once on two streams
    give bit-for-bit the outputs of the same calls made one at a time."""
    dev = torch.device("cuda")
    # split-KV on both (long prefixes, small batches): the partials live in the workspace
    a = workloads.make_batch([20000, 3000], [16, 8], 16, seed=11, device=dev)
    b = workloads.make_batch([9000], [16], 32, seed=12, device=dev)
    want_a = op.verify_attention(*a.kernel_args()).clone()
    want_b = op.verify_attention(*b.kernel_args()).clone()
    torch.cuda.synchronize()
    rounds = 30
    outs_a = [torch.empty_like(want_a) for _ in range(rounds)]
    outs_b = [torch.empty_like(want_b) for _ in range(rounds)]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for r in range(rounds):  # interleaved enqueue: both streams have work in flight at once
        with torch.cuda.stream(s1):
            op.verify_attention(*a.kernel_args(), out=outs_a[r])
        with torch.cuda.stream(s2):
            op.verify_attention(*b.kernel_args(), out=outs_b[r])
    torch.cuda.synchronize()
    bad_a = [r for r in range(rounds) if not torch.equal(outs_a[r], want_a)]
    bad_b = [r for r in range(rounds) if not torch.equal(outs_b[r], want_b)]
    assert not bad_a and not bad_b, f"rounds differing from serial: stream 1 {bad_a}, stream 2 {bad_b}"
    idx = torch.cuda.current_device()
    keys = set(op._workspaces._cur)
    assert {(idx, s1.cuda_stream), (idx, s2.cuda_stream)} <= keys


@pytest.mark.gpu
def test_compiled_caller_equals_eager_and_replays_in_a_cuda_graph():
    """torch.compile (inductor, full graph) gives eager's output; the
    compiled function is captured in a CUDA graph and its replays with new inputs copied
    in equal eager calls on those inputs. (mode="reduce-overhead" is not covered: its
    cudagraph trees refuse the workspace the op takes from its per-stream cache while
    they record, "tensor(s) in the cudagraph pool not tracked as outputs", H200
    2026-12-01; README says so.)"""
    dev = torch.device("cuda")
    b1 = workloads.make_batch([3000, 700], [16, 16], 16, seed=21, device=dev)
    b2 = workloads.make_batch([3000, 700], [16, 16], 16, seed=22, device=dev)
    assert b1.kv_indices.shape == b2.kv_indices.shape and b1.custom_mask.shape == b2.custom_mask.shape

    def fn(q, k_ext, kv, qo, kvp, kvi, mask, mi):
        out = op.verify_attention(q, k_ext, kv, qo, kvp, kvi, mask, mi, b1.sm_scale, b1.max_n)
        return out.float() * 2.0

    eager1 = fn(*b1.kernel_args()[:8]).clone()
    eager2 = fn(*b2.kernel_args()[:8]).clone()
    assert not torch.equal(eager1, eager2)
    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(*b1.kernel_args()[:8]), eager1)

    static = [t.clone() for t in b1.kernel_args()[:8]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up on the capture's stream (its workspace, compiled kernels)
            compiled(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static_out = compiled(*static)
    for batch, want in ((b2, eager2), (b1, eager1), (b2, eager2)):
        for dst, src in zip(static, batch.kernel_args()[:8], strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, want)


def _hooked_call(bs: int, n: int, heads: int, prefix: int, k_given: bool, seed: int = 0):
    """The arguments of one TARGET_VERIFY ``forward_extend`` call on SGLang's real
    ``MLATokenToKVPool`` and ``RadixAttention``, metadata laid out as SGLang's CUDA-graph
    buffers are (int64 ``qo_indptr``): k/v given (the kit's path), or k None with the
    drafts already in the pool at ``out_cache_loc``."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    dev = torch.device("cuda")
    T = bs * n
    size = bs * (prefix + n) + 64
    pool = MLATokenToKVPool(size=size, page_size=1, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64,
                            layer_num=1, device="cuda", enable_memory_saver=False)
    g = torch.Generator(device="cpu").manual_seed(seed)
    slots = (torch.randperm(size - 1, generator=g) + 1).to(dev)
    kv_indices = slots[: bs * prefix]
    out_cache_loc = slots[bs * prefix : bs * prefix + T]
    meta = SimpleNamespace(
        qo_indptr=torch.arange(0, (bs + 1) * n, n, dtype=torch.int64, device=dev),
        kv_indptr=torch.arange(0, (bs + 1) * prefix, prefix, dtype=torch.int32, device=dev),
        kv_indices=kv_indices,
        custom_mask=torch.ones(bs * n * (prefix + n), dtype=torch.uint8, device=dev),
        mask_indptr=torch.arange(0, (bs + 1) * n * (prefix + n), n * (prefix + n), dtype=torch.int64, device=dev),
        max_extend_len=n, swa_out_cache_loc=None)

    class Backend:
        _set_kv_buffer = TritonAttnBackend._set_kv_buffer

    b = Backend()
    b.use_mla, b.dcp_size, b.token_to_kv_pool, b.forward_metadata = True, 1, pool, meta
    b.dllm_attention, b.enable_deterministic = None, False
    b.use_verify_shared_kv = b.use_verify_splitkv = b.use_dense_fp8_chunked_prefill = False
    b.use_sliding_window_kv_pool = False
    fb = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, out_cache_loc=out_cache_loc,
                         out_cache_loc_is_physical=False, seq_lens_cpu=torch.full((bs,), prefix, dtype=torch.int32),
                         _attn_output=None)
    layer = RadixAttention(num_heads=heads, head_dim=576, scaling=576**-0.5, num_kv_heads=1, layer_id=0,
                           v_head_dim=512)
    q = torch.randn(T, heads * 576, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, 1, 576, device=dev, dtype=torch.bfloat16)
    if k_given:
        return b, q, k, k[..., :512], layer, fb
    pool.get_key_buffer(0)[out_cache_loc] = k
    return b, q, None, None, layer, fb


def _launches(call, warmup: int = 3):
    """GPU launches (name -> count) of one hooked call, with the torch profiler, and the
    plugin's kernel-call count over it. The warm-up calls take the first-call work (library
    load, workspace, the step plan) out of the count."""
    import collections
    import json

    from sglang.srt.runtime_context import get_parallel
    from torch.profiler import ProfilerActivity, profile

    from kdtree_engine.sglang import plugin

    def original(*a, **kw):
        raise AssertionError("the hooked call fell back to SGLang's path: " + json.dumps(plugin.status()))

    with get_parallel().override(dcp_enabled=False, tp_rank=0):
        for _ in range(warmup):
            plugin.verify_hook(original, *call)
        torch.cuda.synchronize()
        before = plugin.status()["kernel_calls"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plugin.verify_hook(original, *call)
            torch.cuda.synchronize()
        calls = plugin.status()["kernel_calls"] - before
    names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return names, calls


@pytest.mark.gpu
@pytest.mark.sglang
@pytest.mark.parametrize("k_given", [True, False], ids=["k-given", "k-from-pool"])
def test_launches_per_hooked_call(k_given, capsys):
    """How many GPU launches one hooked verify call makes (printed; run with -s): SGLang's
    KV write when k/v are given, then the main kernel and the combine. The kernel runs once
    per call."""
    from kdtree_pipeline.testing import standins

    standins.install_torchvision_standin()
    standins.install_sgl_kernel_standin()
    from kdtree_engine.sglang import plugin

    plugin._runtime.reset()
    names, calls = _launches(_hooked_call(4, 16, 16, 4096, k_given))
    assert calls == 1
    assert sum(c for n, c in names.items() if "verify_attn" in n) == 1, dict(names)
    with capsys.disabled():
        print(f"\nlaunches per hooked call ({'k given' if k_given else 'k None'}): {sum(names.values())}: {dict(names)}")
