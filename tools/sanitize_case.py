"""A few small kernel calls for compute-sanitizer (memcheck / racecheck).

    compute-sanitizer --tool memcheck python3 tools/sanitize_case.py
"""

import torch

from kdtree_engine.kernel.op import verify_attention
from kdtree_engine.oracle import workloads

# the last case's slots are contiguous: the sm_90a kernel loads its full 32-row groups with TMA
for lens, ns, h, splits, layout in (([70, 0, 33], [7, 3, 16], 8, None, "fragmented"), ([300], [16], 8, 5, "fragmented"),
                                    ([40], [64], 2, 1, "fragmented"), ([300, 130], [16, 4], 8, 2, "contiguous")):
    b = workloads.make_batch(lens, ns, h, tree="eagle", seed=5, device="cuda", layout=layout)
    verify_attention(*b.kernel_args(), num_splits=splits, return_lse=True)
torch.cuda.synchronize()
print("sanitize_case: done")
