"""FlashMLA's dense decode on the bench's inputs, for Nsight Compute (reference data).

    ncu --clock-control none --set full -k regex:"flash|mla|combine" python3 tools/ncu_flashmla.py bs N H prefix
"""

import sys

import torch

from kdtree_engine.bench.peers import PEERS
from kdtree_engine.oracle import workloads

bs, n, h, ctx = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (1, 16, 8, 65536)
b = workloads.make_batch([ctx] * bs, n, h, tree="chain", seed=1, device="cuda", poison_unused=False)
run = PEERS["flashmla"].prepare(b)
for _ in range(3):
    run()
torch.cuda.synchronize()
print(f"ncu_flashmla: bs{bs} N{n} H{h} L{ctx} done")
