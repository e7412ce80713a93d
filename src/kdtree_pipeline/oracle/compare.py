"""Tolerances: how close a bf16 kernel output must be to the fp32 reference.

FlashMLA's tests check a cosine-style difference (1 - 2<x,y>/(|x|^2+|y|^2)
< 1e-5) plus abs/rel closeness; FA3 bounds the error relative to a plain bf16
implementation. We check:

- every element is finite (outputs are poisoned with NaN before each call, so
  an element the kernel did not write fails here),
- cos_diff <= 1e-5 over the whole output,
- |out - ref| <= ATOL + RTOL * |ref| elementwise (bf16 rounding of the output
  alone is 2^-9 relative; the softmax weights are rounded to bf16 before P.V),
- LSE (fp32 in both) within LSE_ATOL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

ATOL = 1e-2
RTOL = 2e-2
COS_DIFF_MAX = 1e-5
LSE_ATOL = 2e-3


@dataclass
class Diff:
    max_abs: float
    max_rel_excess: float  # max of |d| / (ATOL + RTOL |ref|); <= 1 passes
    rel_l2: float
    cos_diff: float
    nonfinite: int
    lse_max_abs: float | None
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def compare(out: torch.Tensor, ref: torch.Tensor, lse: torch.Tensor | None = None,
            lse_ref: torch.Tensor | None = None) -> Diff:
    o = out.float()
    r = ref.float().to(o.device)
    nonfinite = int((~torch.isfinite(o)).sum())
    d = (o - r).abs()
    if nonfinite:
        d = torch.nan_to_num(d, nan=float("inf"))
    max_abs = float(d.max()) if d.numel() else 0.0
    excess = float((d / (ATOL + RTOL * r.abs())).max()) if d.numel() else 0.0
    rn = float(r.norm())
    rel_l2 = float((o - r).norm() / rn) if rn > 0 else float((o - r).norm())
    cd = cos_diff(o, r) if not nonfinite else float("inf")
    lse_err = None
    ok_lse = True
    if lse is not None and lse_ref is not None:
        a, b = lse.float(), lse_ref.float().to(lse.device)
        both_inf = torch.isneginf(a) & torch.isneginf(b)
        diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
        diff = torch.nan_to_num(diff, nan=float("inf"))
        lse_err = float(diff.max()) if diff.numel() else 0.0
        ok_lse = lse_err <= LSE_ATOL
    passed = nonfinite == 0 and excess <= 1.0 and cd <= COS_DIFF_MAX and ok_lse
    return Diff(max_abs, excess, rel_l2, cd, nonfinite, lse_err, passed)
