"""One verify call for Nsight Compute (default: bs 1, N 16, H 8, prefix 65536).
NCU_NOHINT=1: without the host's prefix hint (as the SGLang plugin under graph capture).
NCU_LAYOUT: the slot layout (default fragmented; contiguous runs the sm90 kernel's TMA path).

    ncu --clock-control none --set full -k regex:verify_attn_kernel -c 1 python3 tools/ncu_case.py [bs N H prefix]
"""

import os
import sys

import torch

from kdtree_engine.kernel.op import verify_attention
from kdtree_engine.oracle import workloads

bs, n, h, ctx = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (1, 16, 8, 65536)
b = workloads.make_batch([ctx] * bs, n, h, tree="eagle", layout=os.environ.get("NCU_LAYOUT", "fragmented"), seed=1,
                        device="cuda", poison_unused=False)
out = torch.empty((bs * n, h, 512), dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    verify_attention(*b.kernel_args(), out=out, max_prefix_len=None if os.environ.get("NCU_NOHINT") == "1" else ctx)
torch.cuda.synchronize()
print(f"ncu_case: bs{bs} N{n} H{h} L{ctx} done")
