# ruff: noqa: B023  (the timed lambdas run inside the loop iteration that made them)
"""First timings of the owned kernel next to SGLang's Triton verify path.

    PYTHONPATH=src python3 tools/first_look.py

One process, same inputs (eagle trees, fragmented slots, bf16 random data),
triton.testing.do_bench median in microseconds. No L2 rotation: a first look,
not the bench gate (`nox -s bench` is the measurement of record).
"""

import torch
import triton

from kdtree_engine.kernel.op import verify_attention
from kdtree_pipeline.oracle import workloads

SHAPES = [  # bs, N, H, ctx
    (1, 16, 8, 4096), (1, 16, 8, 23000), (1, 16, 8, 65536), (1, 64, 8, 65536),
    (1, 16, 64, 32768), (8, 16, 8, 32768), (16, 8, 128, 8192), (64, 4, 16, 4096),
]


def sglang_extend(b):
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    T, H = b.q.shape[:2]
    o = torch.empty((T, H, 512), dtype=torch.bfloat16, device="cuda")
    k = b.k_ext
    v = b.k_ext[..., :512]
    pool_v = b.kv_buffer[..., :512]
    mask = b.custom_mask.to(torch.bool) if b.custom_mask.dtype != torch.bool else b.custom_mask

    def run():
        extend_attention_fwd(b.q, k, v, o, b.kv_buffer, pool_v, b.qo_indptr, b.kv_indptr, b.kv_indices,
                             mask, True, b.mask_indptr, b.max_n, 1.0, 1.0, sm_scale=b.sm_scale)
    return run, o


def graph_time(fn, reps=20):
    """Median microseconds of one call, from replays of a CUDA graph holding 10 calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / 10)
    return sorted(ts)[len(ts) // 2]


def main():
    from kdtree_engine.kernel import library

    print(torch.cuda.get_device_name(), "kernel:", library.load().kernel_name(0), flush=True)
    print(f"{'bs':>3} {'N':>3} {'H':>4} {'ctx':>6} | {'ours tree':>10} {'ours chain':>10} {'graph':>8} {'sglang':>10} {'x':>6} | agree")
    for bs, n, h, ctx in SHAPES:
        b = workloads.make_batch([ctx] * bs, n, h, tree="eagle", seed=1, device="cuda", poison_unused=False)
        c = workloads.make_batch([ctx] * bs, n, h, tree="chain", seed=1, device="cuda", poison_unused=False)
        out = torch.empty((b.q.shape[0], h, 512), dtype=torch.bfloat16, device="cuda")
        hint = dict(max_prefix_len=ctx)
        t_tree = triton.testing.do_bench(lambda: verify_attention(*b.kernel_args(), out=out, **hint),
                                         warmup=50, rep=300, return_mode="median") * 1e3
        t_chain = triton.testing.do_bench(lambda: verify_attention(*c.kernel_args(), out=out, **hint),
                                          warmup=50, rep=300, return_mode="median") * 1e3
        t_graph = graph_time(lambda: verify_attention(*b.kernel_args(), out=out, **hint))
        verify_attention(*b.kernel_args(), out=out, **hint)
        try:
            run, o = sglang_extend(b)
            t_sg = triton.testing.do_bench(run, warmup=20, rep=300, return_mode="median") * 1e3
            run()
            agree = f"{(o.float() - out.float()).abs().max().item():.1e}"
        except Exception as e:  # report, keep going
            t_sg, agree = float("nan"), f"sglang failed: {type(e).__name__}: {str(e)[:80]}"
        print(f"{bs:>3} {n:>3} {h:>4} {ctx:>6} | {t_tree:10.1f} {t_chain:10.1f} {t_graph:8.1f} {t_sg:10.1f} {t_sg / t_graph:6.1f} | {agree}",
              flush=True)


if __name__ == "__main__":
    main()


def profile_wrapper(calls: int = 300) -> None:
    """Where the eager wrapper's host time goes (cProfile over many calls)."""
    import cProfile
    import pstats

    b = workloads.make_batch([4096], 16, 8, tree="eagle", seed=1, device="cuda", poison_unused=False)
    out = torch.empty((16, 8, 512), dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        verify_attention(*b.kernel_args(), out=out, max_prefix_len=4096)
    torch.cuda.synchronize()
    import time

    t = time.perf_counter()
    for _ in range(calls):
        verify_attention(*b.kernel_args(), out=out, max_prefix_len=4096)
    torch.cuda.synchronize()
    print(f"host time per eager call: {(time.perf_counter() - t) / calls * 1e6:.1f} us")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        verify_attention(*b.kernel_args(), out=out, max_prefix_len=4096)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(12)


if __name__ == "__main__" and torch.cuda.is_available():
    profile_wrapper()
