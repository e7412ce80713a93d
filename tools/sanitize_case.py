"""A few small kernel calls for compute-sanitizer (memcheck / racecheck).

    compute-sanitizer --tool memcheck python3 tools/sanitize_case.py
    compute-sanitizer --tool racecheck python3 tools/sanitize_case.py 2   (the third case alone)

Each case runs three times: deriving its schedule, making a step plan (csrc/plan.cu), and reading
that plan (a library without plans: once). With case indices (0-5) as arguments, only those cases run, one launch set each and a
synchronisation after each, so that a report can be told to its case (tools/gpu_session.sh,
step racecheck, runs one process per case).
"""

import sys

import torch

from kdtree_engine.kernel import library
from kdtree_engine.kernel.op import VerifyPlan, verify_attention
from kdtree_pipeline.oracle import workloads

# (prefix lengths, drafts per request, heads, splits, layout); the last case's slots are contiguous:
# the sm_90a kernel loads its full 32-row groups with TMA
CASES = (([70, 0, 33], [7, 3, 16], 8, None, "fragmented"), ([300], [16], 8, 5, "fragmented"),
         ([40], [64], 2, 1, "fragmented"), ([300, 130], [16, 4], 8, 2, "contiguous"),
         # several pairs per split and two row tiles: the sm90 producer's L2 prefetch runs
         ([2000], [16], 8, 2, "fragmented"),
         # a GPU-filling grid over a prefix that takes 8 splits: combine_onepass_kernel<8, 10> (csrc/combine.cuh)
         ([1000], [16], 8, 64, "fragmented"))
picked = [int(a) for a in sys.argv[1:]] or range(len(CASES))
# which kernel and tile the sanitizer sees (KDTREE_TARGET=sm_120: the emulated sm_120 tile)
lib = library.load()
print(f"sanitize_case: library {lib.path}, kernel {lib.kernel_name(torch.cuda.current_device())}")
for i in picked:
    lens, ns, h, splits, layout = CASES[i]
    b = workloads.make_batch(lens, ns, h, tree="eagle", seed=5, device="cuda", layout=layout)
    verify_attention(*b.kernel_args(), num_splits=splits, return_lse=True)
    if lib.has_plan:  # the plan kernel, then a call that reads the plan (calls outside the batch schedule ignore it)
        plan = VerifyPlan()
        verify_attention(*b.kernel_args(), num_splits=splits, return_lse=True, plan=plan, make_plan=True)
        verify_attention(*b.kernel_args(), return_lse=True, plan=plan)
    torch.cuda.synchronize()
    print(f"sanitize_case: case {i} done (lens {lens}, drafts {ns}, heads {h}, splits {splits}, {layout})")
print("sanitize_case: done")
