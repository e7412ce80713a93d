"""The closed form of uniform-plan.patch against op.batch_plan's search (CPU only)."""

import itertools

from kdtree_engine.kernel import op

n = bad = 0
for bs, nd, H, L, budget in itertools.product(
    [2, 3, 8, 16, 32, 64, 128], [1, 4, 8, 16, 32, 64], [8, 16, 64, 128],
    [0, 100, 1024, 4096, 8191, 32768, 65536, 131072], [132, 188, 64, 17],
):
    rows = nd * H
    tiles = bs * -(-rows // op.PLAN_BM)
    if budget <= tiles:
        continue
    steps = max(1, -(-(L + nd) // 128))
    per_min = -(-op.SPLIT_MIN_KEYS // 128)
    per = max(per_min, -(-steps // (budget // tiles)))
    sp = -(-steps // per)
    want = [(sp, i * sp * rows if sp > 1 else 0) for i in range(bs)]
    n += 1
    if op.batch_plan([L] * bs, [nd] * bs, H, 128, budget) != want:
        bad += 1
        print("mismatch:", bs, nd, H, L, budget)
print(f"{n} uniform batches, {bad} mismatches")
raise SystemExit(1 if bad else 0)
