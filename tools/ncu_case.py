"""One verify call for Nsight Compute (default: bs 1, N 16, H 8, prefix 65536).
NCU_NOHINT=1: without the host's prefix hint (as the SGLang plugin under graph capture).
NCU_LAYOUT: the slot layout (default fragmented; contiguous runs the sm90 kernel's TMA path).
NCU_LENS: a comma list of prefix lengths, one request each (a ragged batch; bs and prefix are
then ignored, e.g. NCU_LENS=32768,16384,8192,4096,2048,1024,512,256 for the bench's geometric32k).
NCU_PLAN=1: the calls make and read a step plan (op.VerifyPlan), as the bench's `ours` and the
SGLang plugin's calls do; without it each CTA of a batch derives its job in the kernel.

    ncu --clock-control none --set full -k regex:verify_attn_kernel -c 1 python3 tools/ncu_case.py [bs N H prefix]
"""

import os
import sys

import torch

from kdtree_engine.kernel.op import VerifyPlan, verify_attention
from kdtree_pipeline.oracle import workloads

bs, n, h, ctx = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (1, 16, 8, 65536)
lens = [int(x) for x in os.environ["NCU_LENS"].split(",")] if os.environ.get("NCU_LENS") else [ctx] * bs
bs, ctx = len(lens), max(lens)
b = workloads.make_batch(lens, n, h, tree="eagle", layout=os.environ.get("NCU_LAYOUT", "fragmented"), seed=1,
                        device="cuda", poison_unused=False)
out = torch.empty((bs * n, h, 512), dtype=torch.bfloat16, device="cuda")
plan = VerifyPlan() if os.environ.get("NCU_PLAN") == "1" else None
for i in range(3):  # the first call makes the plan (its plan kernel, then a main kernel that reads it)
    verify_attention(*b.kernel_args(), out=out, max_prefix_len=None if os.environ.get("NCU_NOHINT") == "1" else ctx,
                     plan=plan, make_plan=plan is not None and i == 0)
torch.cuda.synchronize()
print(f"ncu_case: bs{bs} N{n} H{h} L{ctx} done")
