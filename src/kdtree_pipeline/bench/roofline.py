"""The roofline floor of a verify call, from ceilings measured on the same GPU.

Two ceilings, measured in the bench run itself (METHOD: "measure the two
ceilings once on the device machine"):

- copy bandwidth: a large device-to-device copy, bytes read + bytes written
  over the median time;
- bf16 matmul rate: an 8192^3 product of random bf16 matrices, 2 n^3 flops
  over the median time.

Floor of a case = max(bytes / bandwidth, flops / rate) with

- bytes = every request's prefix KV read once (prefix x 1152) + q + k_ext + out,
- flops = 2 x rows x keys x (576 + 512) per request (QK^T over 576 dims, PV over
  512), rows = N x H, keys = prefix + N,

each summed over the requests with their own prefix lengths (``Case.prefix_lens``: a
ragged batch's bytes and flops are the sums of its requests').

The sm_120 floor (:data:`SM120_RTX_PRO_6000`) is a prediction, not a measurement:
the same bytes and flops over an RTX PRO 6000 Blackwell's documented memory
bandwidth and dense bf16 tensor rate with fp32 accumulation (sources in
docs/sm120.md). No sm_120 GPU is available here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kdtree_pipeline.bench.suites import Case

HEAD_DIM = 576
V_DIM = 512
BF16 = 2
SLOT_BYTES = HEAD_DIM * BF16  # 1152
#: measured on the H200, docs/design.md section 6 (for reference only: the gate measures its own)
DESIGN_H200_COPY_BPS = 4.27e12
DESIGN_H200_MATMUL_FLOPS = 790e12

@dataclass(frozen=True)
class Ceilings:
    """Copy bandwidth and bf16 matmul rate (measured, or documented for ``predicted``)."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float
    copy_bytes: int = 0  # bytes read + written per copy timed
    matmul_n: int = 0
    predicted: str | None = None  # what a documented (not measured) pair of ceilings is

    def as_dict(self) -> dict:
        d = asdict(self)
        d["copy_tb_s"] = self.copy_bytes_per_s / 1e12
        d["matmul_tflop_s"] = self.matmul_flops_per_s / 1e12
        return d


#: RTX PRO 6000 Blackwell (sm_120): 1792 GB/s GDDR7 and the dense bf16 tensor rate with fp32
#: accumulation, as published for the product (docs/sm120.md gives the sources).
#: A prediction: the floor an sm_120 user can expect, not a figure measured here.
SM120_RTX_PRO_6000 = Ceilings(copy_bytes_per_s=1.792e12, matmul_flops_per_s=503.8e12,
                              predicted="RTX PRO 6000 Blackwell datasheet: 1792 GB/s, 503.8 TFLOP/s dense bf16")



def case_bytes(case: Case) -> int:
    """Fewest bytes a verify call moves: every request's KV once, q, k_ext, out."""
    kv = case.total_prefix * SLOT_BYTES
    q = case.rows * HEAD_DIM * BF16
    k_ext = case.tokens * HEAD_DIM * BF16
    out = case.rows * V_DIM * BF16
    return kv + q + k_ext + out


def case_flops(case: Case) -> int:
    """2 x rows x keys x (576 + 512) summed over the batch (keys = that request's prefix + N)."""
    rows_per_req = case.n * case.heads
    keys = case.total_prefix + case.bs * case.n
    return 2 * rows_per_req * keys * (HEAD_DIM + V_DIM)


def floor_us(case: Case, ceil: Ceilings) -> float:
    """max(bytes / bandwidth, flops / rate) in microseconds."""
    if ceil.copy_bytes_per_s <= 0 or ceil.matmul_flops_per_s <= 0:
        raise ValueError(f"ceilings must be positive, got {ceil}")
    return max(case_bytes(case) / ceil.copy_bytes_per_s, case_flops(case) / ceil.matmul_flops_per_s) * 1e6


def floor_terms(case: Case, ceil: Ceilings) -> dict:
    """The floor and its two terms (which one binds)."""
    mem = case_bytes(case) / ceil.copy_bytes_per_s * 1e6
    comp = case_flops(case) / ceil.matmul_flops_per_s * 1e6
    return {"floor_us": max(mem, comp), "memory_us": mem, "compute_us": comp,
            "bound": "memory" if mem >= comp else "compute",
            "bytes": case_bytes(case), "flops": case_flops(case)}


def _median_ms(fn, reps: int) -> float:
    from kdtree_pipeline.bench.timing import timed_ms

    times = sorted(timed_ms(fn) for _ in range(reps))
    return times[len(times) // 2]


def _copy_ms(n_el: int, reps: int) -> float:
    import torch

    # An explicit generator: a peer whose CUDA-graph capture failed earlier in the
    # run can leave the default CUDA generator unusable ("Offset increment outside
    # graph capture"); seen on the H200.
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(n_el, device="cuda", dtype=torch.bfloat16, generator=g)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    return _median_ms(lambda: dst.copy_(src), reps)


def _matmul_ms(n: int, reps: int) -> float:
    import torch

    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn((n, n), device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn((n, n), device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    return _median_ms(lambda: torch.matmul(a, b, out=c), reps)


def measure(copy_bytes: int = 2 << 30, matmul_n: int = 8192, reps: int = 9) -> Ceilings:
    """Measure copy bandwidth and bf16 matmul rate on the current CUDA device (random data)."""
    import torch

    n_el = copy_bytes // 2
    t_copy = _copy_ms(n_el, reps)
    t_mm = _matmul_ms(matmul_n, reps)
    torch.cuda.empty_cache()
    moved = 2 * n_el * 2  # read + write
    return Ceilings(copy_bytes_per_s=moved / (t_copy * 1e-3),
                    matmul_flops_per_s=2 * matmul_n**3 / (t_mm * 1e-3),
                    copy_bytes=moved, matmul_n=matmul_n)
