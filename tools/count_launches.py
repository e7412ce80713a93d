"""Count the GPU launches of one hooked verify call (issue 18 item 5), with the torch profiler.

    python tools/count_launches.py [--bs 4] [--n 16] [--heads 16] [--prefix 4096] [--layers 61]

Runs the plugin's hooked path (``plugin.verify_hook`` -> fallback predicates ->
``prepare`` -> ``save_kv`` with SGLang's own ``_set_kv_buffer`` -> the kernel) on
SGLang's real ``MLATokenToKVPool`` and ``RadixAttention`` on the GPU, with metadata
laid out as SGLang's CUDA-graph buffers are (int64 ``qo_indptr``), once with k/v given
(the kit's path) and once with k = None (drafts read back from the pool). Prints every
kernel, memcpy and memset launched per call, and the total over ``--layers`` layers.
It reads only names and counts, so it works before and after the C-ABI change
(int64 indptrs, drafts read by slot id, no separate clear kernel).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from types import SimpleNamespace

import torch


def _setup_sglang():
    from kdtree_pipeline.testing import standins

    standins.install_torchvision_standin()
    standins.install_sgl_kernel_standin()


def make_call(bs: int, n: int, heads: int, prefix: int, k_given: bool, seed: int = 0):
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


def count(call, warmup: int = 3) -> tuple[collections.Counter, int]:
    """Launches (name -> count) of one hooked call, and the plugin's kernel-call count."""
    from sglang.srt.runtime_context import get_parallel
    from torch.profiler import ProfilerActivity, profile

    from kdtree_engine.sglang import plugin

    def original(*a, **kw):
        raise AssertionError("the hooked call fell back to SGLang's path: " + json.dumps(plugin.status()))

    with get_parallel().override(dcp_enabled=False, tp_rank=0):
        for _ in range(warmup):  # library load, workspace, device check: first-call work out of the count
            plugin.verify_hook(original, *call)
        torch.cuda.synchronize()
        before = plugin.status()["kernel_calls"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            plugin.verify_hook(original, *call)
            torch.cuda.synchronize()
        calls = plugin.status()["kernel_calls"] - before
    names = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
    return names, calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=61)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("count_launches: needs a CUDA GPU", file=sys.stderr)
        return 1
    _setup_sglang()
    from kdtree_engine.sglang import plugin

    plugin._runtime.reset()
    report = {}
    for label, k_given in (("k/v given", True), ("k None (drafts from the pool)", False)):
        names, calls = count(make_call(args.bs, args.n, args.heads, args.prefix, k_given))
        total = sum(names.values())
        report[label] = {"launches": total, "kernel_calls": calls, "by_name": dict(names)}
        print(f"{label}: {total} launches per hooked call, {total * args.layers} over {args.layers} layers")
        for name, c in names.most_common():
            print(f"  {c:3d}  {name[:110]}")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
