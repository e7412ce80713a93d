"""One verify call at bs 1, N 16, H 8, prefix 65536, for Nsight Compute.

    ncu --clock-control none --set full -k regex:verify_attn_kernel -c 1 python3 tools/ncu_case.py
"""

import torch

from kdtree_engine.kernel.op import verify_attention
from kdtree_engine.oracle import workloads

b = workloads.make_batch([65536], 16, 8, tree="eagle", seed=1, device="cuda", poison_unused=False)
out = torch.empty((16, 8, 512), dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    verify_attention(*b.kernel_args(), out=out, max_prefix_len=65536)
torch.cuda.synchronize()
print("ncu_case: done")
