"""FlashMLA's dense decode on the bench's inputs, for Nsight Compute (reference data).

    ncu --clock-control none --set full -k regex:"flash|mla|combine" python3 tools/ncu_flashmla.py bs N H prefix
    ... python3 tools/ncu_flashmla.py bs N H prefix --fm-src build/lib/fmnold

--fm-src DIR calls FlashMLA built from source by tools/build_fm_src.py (tools/fm_src_peer.py; built
with -lineinfo, so ncu's source page maps its samples to FlashMLA's lines) instead of the wheel.
"""

import argparse
import sys
from pathlib import Path

import torch

from kdtree_pipeline.bench.peers import PEERS
from kdtree_pipeline.oracle import workloads

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: fm_src_peer
import fm_src_peer  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("shape", nargs="*", type=int, help="bs N H prefix (default 1 16 8 65536)")
ap.add_argument("--fm-src", default=None, metavar="DIR", help="a tools/build_fm_src.py folder instead of the wheel")
args = ap.parse_args()
if args.shape and len(args.shape) != 4:
    ap.error(f"expected bs N H prefix, got {args.shape}")
bs, n, h, ctx = args.shape or (1, 16, 8, 65536)
system = "flashmla"
if args.fm_src:
    system = fm_src_peer.register([f"fm-src={args.fm_src}"])[0]
    why = PEERS[system].check()
    if why:
        sys.exit(f"ncu_flashmla: --fm-src {args.fm_src}: {why}")
b = workloads.make_batch([ctx] * bs, n, h, tree="chain", seed=1, device="cuda", poison_unused=False)
run = PEERS[system].prepare(b)
for _ in range(3):
    run()
torch.cuda.synchronize()
print(f"ncu_flashmla: {system} bs{bs} N{n} H{h} L{ctx} done")
