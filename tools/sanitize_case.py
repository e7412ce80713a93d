"""A few small kernel calls for compute-sanitizer (memcheck / racecheck).

    compute-sanitizer --tool memcheck python3 tools/sanitize_case.py
"""

import torch

from kdtree_engine.kernel.op import verify_attention
from kdtree_engine.oracle import workloads

for lens, ns, h, splits in (([70, 0, 33], [7, 3, 16], 8, None), ([300], [16], 8, 5), ([40], [64], 2, 1)):
    b = workloads.make_batch(lens, ns, h, tree="eagle", seed=5, device="cuda")
    verify_attention(*b.kernel_args(), num_splits=splits, return_lse=True)
torch.cuda.synchronize()
print("sanitize_case: done")
