"""The binding's argument checks (CPU) and, on a GPU, the kernel against the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdtree_engine.kernel import op
from kdtree_engine.kernel.op import (
    VerifyArgs,
    VerifyArgumentError,
    check_arguments,
    choose_num_splits,
)
from kdtree_pipeline.oracle import compare, reference, workloads


def _batch(**kw):
    args = dict(prefix_lens=[5, 0, 9], n_drafts=[4, 2, 3], num_heads=2, seed=0, spare_slots=4)
    args.update(kw)
    return workloads.make_batch(**args)


def _args(b: workloads.Batch) -> dict:
    return dict(q=b.q, k_ext=b.k_ext, kv_buffer=b.kv_buffer, qo_indptr=b.qo_indptr, kv_indptr=b.kv_indptr,
                kv_indices=b.kv_indices, custom_mask=b.custom_mask, mask_indptr=b.mask_indptr,
                sm_scale=b.sm_scale, max_n=b.max_n)


def test_valid_cpu_batch_fails_only_on_device():
    a = _args(_batch())
    shapes = check_arguments(VerifyArgs(**a), require_cuda=False)
    assert (shapes.bs, shapes.total_tokens, shapes.num_heads, shapes.max_n) == (3, 9, 2, 4)
    with pytest.raises(VerifyArgumentError, match=r"'q': expected a CUDA tensor"):
        check_arguments(VerifyArgs(**a))


BAD = [
    ("q", lambda a: a["q"].float(), "'q': expected dtype torch.bfloat16"),
    ("q", lambda a: a["q"][..., :512], r"'q': expected shape \[tokens, heads, 576\]"),
    ("q", lambda a: torch.zeros((9, 129, 576), dtype=torch.bfloat16), "'q': expected 1..128 heads"),
    ("q", lambda a: torch.zeros((9, 2, 580), dtype=torch.bfloat16)[..., :576],
     "'q': expected row strides that are multiples of 8"),
    ("k_ext", lambda a: a["k_ext"][:8], "'k_ext': expected 9 rows"),
    ("k_ext", lambda a: a["k_ext"].to(torch.float16), "'k_ext': expected dtype torch.bfloat16"),
    ("k_ext", lambda a: a["k_ext"].view(9, 2, 288), r"'k_ext': expected shape \[rows, 1, 576\]"),
    ("kv_buffer", lambda a: a["kv_buffer"][:, :, :512], r"'kv_buffer': expected shape"),
    ("kv_buffer", lambda a: a["kv_buffer"][:0], "'kv_buffer': expected at least one slot"),
    ("kv_buffer", lambda a: torch.zeros((40, 580), dtype=torch.bfloat16)[:, :576],
     "'kv_buffer': expected row strides that are multiples of 8"),
    ("qo_indptr", lambda a: a["qo_indptr"].short(), "'qo_indptr': expected dtype torch.int32 or torch.int64"),
    ("kv_indptr", lambda a: a["kv_indptr"][:3], "'kv_indptr': expected 4 elements"),
    ("kv_indptr", lambda a: a["kv_indptr"].float(), "'kv_indptr': expected dtype torch.int32 or torch.int64"),
    ("kv_indices", lambda a: a["kv_indices"].float(), "'kv_indices': expected dtype torch.int64 or torch.int32"),
    ("kv_indices", lambda a: a["kv_indices"][None], "'kv_indices': expected a 1-D tensor"),
    ("custom_mask", lambda a: a["custom_mask"].float(), "'custom_mask': expected dtype torch.bool or torch.uint8"),
    ("mask_indptr", lambda a: a["mask_indptr"].int(), "'mask_indptr': expected dtype torch.int64"),
    ("mask_indptr", lambda a: a["mask_indptr"][:2], "'mask_indptr': expected 4 elements"),
    ("max_n", lambda a: 129, "'max_n': expected 0..128"),
    ("max_n", lambda a: 2, "'max_n': expected at least q.shape"),
    ("max_n", lambda a: 4.0, "'max_n': expected a Python int"),
    ("sm_scale", lambda a: float("nan"), "'sm_scale': expected a positive finite float"),
    ("sm_scale", lambda a: 0.0, "'sm_scale': expected a positive finite float"),
    ("sm_scale", lambda a: -0.04, "'sm_scale': expected a positive finite float"),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_argument_is_named(name, mutate, message):
    a = _args(_batch())
    a[name] = mutate(a)
    with pytest.raises(VerifyArgumentError, match=message):
        check_arguments(VerifyArgs(**a), require_cuda=False)


def test_out_and_lse_are_checked():
    b = _batch()
    a = _args(b)
    with pytest.raises(VerifyArgumentError, match=r"'out': expected shape \[9, 2, 512\]"):
        check_arguments(VerifyArgs(**a, out=torch.empty((9, 2, 576), dtype=torch.bfloat16)), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match="'out': expected a contiguous last dimension"):
        check_arguments(VerifyArgs(**a, out=torch.empty((9, 2, 512, 2), dtype=torch.bfloat16)[..., 0]), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match="'lse': expected a contiguous tensor of shape"):
        check_arguments(VerifyArgs(**a, lse=torch.empty((2, 9)).t()), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match="'lse': expected dtype torch.float32"):
        check_arguments(VerifyArgs(**a, lse=torch.empty((9, 2), dtype=torch.float64)), require_cuda=False)


def test_out_may_not_overlap_inputs():
    b = _batch()
    a = _args(b)
    flat = torch.zeros(9 * 2 * 576 + 9 * 2 * 512, dtype=torch.bfloat16)
    a["q"] = flat[: 9 * 2 * 576].view(9, 2, 576)
    with pytest.raises(VerifyArgumentError, match="'out': expected memory that does not overlap 'q'"):
        check_arguments(VerifyArgs(**a, out=flat[512 * 8 : 512 * 8 + 9 * 2 * 512].view(9, 2, 512)), require_cuda=False)
    check_arguments(VerifyArgs(**a, out=flat[9 * 2 * 576 :].view(9, 2, 512)), require_cuda=False)  # adjacent
    # interleaved strided views of one buffer do not overlap and are accepted
    buf = torch.zeros((9, 2, 1024 + 64), dtype=torch.bfloat16)
    a["q"] = buf[:, :, :576]
    check_arguments(VerifyArgs(**a, out=buf[:, :, 576:1088]), require_cuda=False)


def test_mask_length_checked_when_prefix_lengths_are_known():
    b = workloads.make_batch([5, 9], [3, 3], 2, seed=1)
    a = _args(b)
    check_arguments(VerifyArgs(**a, prefix_lens_cpu=[5, 9]), require_cuda=False)
    a["custom_mask"] = a["custom_mask"][:-1]
    with pytest.raises(VerifyArgumentError, match=r"'custom_mask': expected >= 60 entries"):
        check_arguments(VerifyArgs(**a, prefix_lens_cpu=[5, 9]), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match="'prefix_lens_cpu': expected 2 prefix lengths"):
        check_arguments(VerifyArgs(**a, prefix_lens_cpu=[5]), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match=r"'kv_indices': expected >= 20 slot ids"):
        check_arguments(VerifyArgs(**_args(b), prefix_lens_cpu=[11, 9]), require_cuda=False)


def test_choose_num_splits_fills_whole_waves():
    # bs=1, N=16, H=8 -> 2 row tiles of 64 rows: 66 splits fill 132 SMs in one wave
    assert choose_num_splits(1, 16, 8, 132, 64) == 66
    # N=64 -> 8 row tiles: 16 splits (128 CTAs, one wave), not 17 (136 CTAs, two waves)
    assert choose_num_splits(1, 64, 8, 132, 64) == 16
    # short prefix: ceil((prefix + N) / 128) splits, the device's own rule (csrc/common.cuh split_plan)
    assert choose_num_splits(1, 16, 8, 132, 64, max_prefix_len=240) == 2
    assert choose_num_splits(1, 16, 8, 132, 64, max_prefix_len=4096) == 33
    # a big batch fills the GPU on its own
    assert choose_num_splits(16, 8, 128, 132, 64) == 1
    # no drafts still counts one row tile per request (never zero CTAs, never a division by zero)
    assert choose_num_splits(1, 0, 8, 132, 64) == choose_num_splits(1, 1, 8, 132, 64) == 132
    # more SMs than splits allowed: capped at max_splits
    assert choose_num_splits(1, 1, 1, 1000, 64) == 256
    assert choose_num_splits(1, 1, 1, 1000, 64, max_splits=40) == 40


SPLIT_PLAN_MAIN = r"""
#include <cstdio>
#include "common.cuh"
int main() {  // "KV num_splits split_keys" per line in, "splits per" per line out
  int kv, s, k;
  while (scanf("%d %d %d", &kv, &s, &k) == 3) {
    const kdtree::SplitPlan sp = kdtree::split_plan(kv, s, k);
    printf("%d %d\n", sp.splits, sp.per);
  }
  return 0;
}
"""


@pytest.mark.nvcc
def test_split_plan_mirror_and_properties(tmp_path):
    """The split schedule every CTA computes on the device (csrc/common.cuh
    split_plan, compiled here for the host by nvcc and run on the CPU). For every length
    and grid: at least one split, at most the grid's num_splits (and 1024), about 128 keys
    per split at the least, every split non-empty and together covering every key; where
    the grid is what limits it, each split is exactly as long as the host-only schedule
    made it (whole 32-key tiles; for the sm90 kernel (128-key steps) whole pairs of
    64-key blocks, never a padding block but at a request's end). The Python mirror
    (op.split_plan: the fast-path test uses it) agrees with it
    everywhere."""
    import shutil
    import subprocess

    src = tmp_path / "plan.cu"
    src.write_text(SPLIT_PLAN_MAIN)
    exe = tmp_path / "plan"
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    subprocess.run([shutil.which("nvcc"), "-std=c++17", "-I", str(csrc), "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    lengths = list(range(0, 700)) + [1000, 1040, 1041, 4096, 4112, 5064, 23016, 65552, 91016, 131200, 2**20,
                                     2**31 - 256]
    grids = (1, 2, 3, 7, 16, 33, 64, 66, 132, 256, 1024, 1025, 5000, 65535)
    cases = [(kv, s, k) for kv in lengths for s in grids for k in (32, 128)]
    out = subprocess.run([str(exe)], input="".join(f"{kv} {s} {k}\n" for kv, s, k in cases), check=True,
                         capture_output=True, text=True).stdout.splitlines()
    for (kv, s, k), line in zip(cases, out, strict=True):
        splits, per = map(int, line.split())
        where = f"KV={kv} num_splits={s} split_keys={k}: splits={splits} per={per}"
        assert (splits, per) == op.split_plan(kv, s, k), where
        assert 1 <= splits <= min(s, 1024) and splits <= max(1, -(-kv // 128)), where
        assert (splits - 1) * per * k < max(kv, 1) <= splits * per * k, where  # non-empty, all covered
        if s == 1:
            assert splits == 1, where
        if s <= 1024 and -(-kv // 128) >= s:  # the grid limits it: the old schedule's split length
            blocks = -(-kv // (64 if k == 128 else 32))
            old = -(-blocks // s)
            assert per * k == (-(-old // 2) * 128 if k == 128 else old * 32), where


def test_qo_indptr_of_the_wrong_length_is_named():
    """kv_indptr and mask_indptr agree on bs + 1, qo_indptr does not: name qo_indptr."""
    a = _args(_batch())
    a["qo_indptr"] = a["qo_indptr"][:3]
    with pytest.raises(VerifyArgumentError, match=r"'qo_indptr': expected 4 elements .*, got 3"):
        check_arguments(VerifyArgs(**a), require_cuda=False)
    a = _args(_batch())
    a["qo_indptr"] = torch.cat([a["qo_indptr"], a["qo_indptr"][-1:]])
    with pytest.raises(VerifyArgumentError, match=r"'qo_indptr': expected 4 elements .*, got 5"):
        check_arguments(VerifyArgs(**a), require_cuda=False)


def test_custom_op_is_registered_with_a_fake_that_checks_arguments():
    """The op's fake (what torch.compile runs while tracing) accepts a valid call on fake
    tensors, returns nothing, and refuses a bad one with the eager path's error."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert op.OP_NAME == "kdtree::verify_attention"
    b = _batch()
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) for t in b.kernel_args()[:8]]
    with mode:
        out = torch.empty((9, 2, 512), dtype=torch.bfloat16)
        got = torch.ops.kdtree.verify_attention(*fake, out, None, None, b.sm_scale, b.max_n, 0, -1, 0)
        assert got is None
        with pytest.raises(VerifyArgumentError, match=r"'out': expected shape \[9, 2, 512\]"):
            torch.ops.kdtree.verify_attention(*fake, out[:, :, :256], None, None, b.sm_scale, b.max_n, 0, -1, 0)
        with pytest.raises(VerifyArgumentError, match="'max_n'"):
            torch.ops.kdtree.verify_attention(*fake, out, None, None, b.sm_scale, 2, 0, -1, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tree", ["eagle", "chain", "star"])
def test_kernel_matches_reference_small(tree):
    b = workloads.make_batch([70, 0, 33], [7, 3, 16], 8, tree=tree, seed=2, device="cuda")
    out = torch.full((b.q.shape[0], 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((b.q.shape[0], 8), float("nan"), device="cuda")
    op.verify_attention(*b.kernel_args(), out=out, lse=lse)
    ref, ref_lse = reference.verify_attention_ref(*b.ref_args())
    d = compare.compare(out, ref, lse, ref_lse)
    assert d.passed, d


def _target_or_skip(target: str) -> None:
    from kdtree_pipeline.oracle.gate import default_targets

    if target not in default_targets(torch.cuda.current_device()):
        pytest.skip(f"target {target} does not run on this GPU")


#: (prefix lengths, drafts per request, heads): far shorter than 64 splits need
SPLIT_CASES = [
    ([300], [16], 8),
    ([1000], [16], 8),
    ([300], [1], 8),
    ([1000], [64], 8),
    ([0, 100, 5000], [1, 7, 64], 8),
    ([0, 100, 5000], [16, 16, 16], 16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "L" + "-".join(map(str, c[0])) + "-N" +
                         "-".join(map(str, c[1])) + f"-H{c[2]}")
def test_splits_far_above_what_the_lengths_need(target, return_lse, case):
    """With num_splits forced to 64 (as the GPU-filling grid under graph capture,
    where no host hint exists), each request takes only the splits its length needs
    (csrc/common.cuh split_plan): the other CTAs write nothing, a request of one split
    (prefix 0 and 100 here) writes its output directly, the combine merges only a row's
    own splits. The workspace past its header is all 0xFF bytes (NaN as fp32), so a
    partial that some split did not write but the combine read shows up as NaN."""
    from kdtree_engine.kernel import library

    _target_or_skip(target)
    lens, ns, H = case
    b = workloads.make_batch(lens, ns, H, seed=sum(lens) + len(ns), device="cuda")
    lib = library.load()
    T = b.q.shape[0]
    ws = torch.full((lib.workspace_bytes(T * H, 64),), 0xFF, dtype=torch.uint8, device="cuda")
    ws[: op.WS_HEADER].zero_()
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = op.verify_attention(*b.kernel_args(), out=out, num_splits=64, workspace=ws, return_lse=return_lse,
                              target=target)
    lse = got[1] if return_lse else None
    ref, ref_lse = reference.verify_attention_ref(*b.ref_args())
    d = compare.compare(out, ref, lse, ref_lse if return_lse else None)
    assert d.passed, d
    assert lib.read_device_error(ws.data_ptr(), torch.cuda.current_stream().cuda_stream) == 0


def _verify_graph(heads: int, n: int, max_bs: int, max_prefix: int, seed: int):
    """A random bf16 pool on the GPU and the graph gate's fixed verify buffers over it."""
    from kdtree_pipeline.graph.capture import Capacity, VerifyGraph

    cap = Capacity(max_bs=max_bs, max_n=n, max_prefix_tokens=max_bs * max_prefix + max_bs, num_heads=heads,
                   max_prefix_len=max_prefix)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn((cap.max_prefix_tokens + 1, 1, 576), generator=gen).to(torch.bfloat16).to("cuda")
    return pool, VerifyGraph(pool, cap, workloads.DEEPSEEK_SM_SCALE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_graph_without_hint_replays_shorter_and_longer_prefixes(target):
    """As SGLang runs verify: one capture with no host hint (the grid takes the
    GPU-filling split count), then replays with other lengths written into the same
    buffers on the device. Every replay matches the reference: the short ones take few
    splits (a request of prefix 0 or 100 one, written without the combine), and a replay
    after a longer one never reads the partials its unused splits left in the workspace."""
    from kdtree_pipeline.graph.capture import capture_graph
    from kdtree_pipeline.graph.gate import _step

    _target_or_skip(target)
    heads, n = 8, 16
    sm_scale = workloads.DEEPSEEK_SM_SCALE
    pool, vg = _verify_graph(heads, n, max_bs=2, max_prefix=6000, seed=4)

    def call() -> None:  # no max_prefix_len and no prefix_lens_cpu: what the plugin passes under capture
        op.verify_attention(vg.q, vg.k_ext, vg.kv_buffer, vg.qo_indptr, vg.kv_indptr, vg.kv_indices, vg.custom_mask,
                            vg.mask_indptr, sm_scale, n, out=vg.out, lse=vg.lse, target=target)

    vg.load(_step(pool, [1000, 1000], n, heads, "eagle", 1, sm_scale))
    graph, _ = capture_graph(call)
    for i, lens in enumerate(([1000, 1000], [300], [6000, 4096], [0, 100], [5000, 1], [300, 300], [6000])):
        b = _step(pool, lens, n, heads, "eagle", 10 + i, sm_scale)
        vg.load(b)
        vg.out.fill_(float("nan"))
        vg.lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        T = b.bs * n
        ref, ref_lse = reference.verify_attention_ref(*b.ref_args())
        d = compare.compare(vg.out[:T], ref, vg.lse[:T], ref_lse)
        assert d.passed, (lens, d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_a_call_sees_what_the_kernel_just_before_it_wrote(target):
    """The main kernel is launched as a programmatic dependent of the kernel before it
    (csrc/launch.h), and a main kernel lets its dependents launch at its first statement.
    So call B, launched right after call A with nothing between them (one split each: no
    combine), may start while A runs. B's q is A's out (the first 512 columns of one
    buffer): B matches the reference only if it waits for A (griddepcontrol.wait) before
    it reads its inputs."""
    _target_or_skip(target)
    H, n = 8, 16
    a = workloads.make_batch([20000], [n], H, seed=21, device="cuda")
    b = workloads.make_batch([3000], [n], H, seed=22, device="cuda")
    T = a.q.shape[0]
    x = torch.zeros((T, H, 576), dtype=torch.bfloat16, device="cuda")  # stale value of B's q: zeros
    x[..., 512:] = b.q[..., 512:]
    out_b = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    op.verify_attention(*a.kernel_args(), out=x[..., :512], num_splits=1, target=target)
    op.verify_attention(x, *b.kernel_args()[1:], out=out_b, num_splits=1, target=target)
    torch.cuda.synchronize()
    ref_a, _ = reference.verify_attention_ref(*a.ref_args())
    assert compare.compare(x[..., :512], ref_a).passed  # A wrote its output into B's q
    ref_b, _ = reference.verify_attention_ref(x.clone(), *b.ref_args()[1:])
    d = compare.compare(out_b, ref_b)
    assert d.passed, d  # B read that q, not the zeros before it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bad_input_writes_nothing_on_gpu():
    b = workloads.make_batch([70], [7], 8, seed=3, device="cuda")
    out = torch.full((7, 8, 512), 7.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(VerifyArgumentError):
        op.verify_attention(*b.kernel_args()[:-1], 129, out=out)
    assert bool((out == 7.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_device_error_word_reports_a_bad_slot_until_it_is_read(monkeypatch, num_splits):
    """The device-side check (no host sync): a slot id past the pool sets bit 1 of the
    workspace's error word and that key is skipped. No kernel clears the word (no clear
    launch per call): it holds the bits until kdtree_read_device_error reads them, which
    clears it. The rest of the workspace may hold anything (0xFF here)."""
    from kdtree_engine.kernel import library

    monkeypatch.delenv("KDTREE_DEBUG", raising=False)
    lib = library.load()
    b = workloads.make_batch([300], [7], 8, seed=5, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    ws = torch.full((lib.workspace_bytes(7 * 8, num_splits),), 0xFF, dtype=torch.uint8, device="cuda")
    ws[: op.WS_HEADER].zero_()
    bad = b.kv_indices.clone()
    bad[123] = b.kv_buffer.shape[0] + 5
    args = list(b.kernel_args())
    args[5] = bad
    op.verify_attention(*args, num_splits=num_splits, workspace=ws)
    out = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws)
    assert lib.read_device_error(ws.data_ptr(), stream) == 1  # sticky across the valid call
    assert lib.read_device_error(ws.data_ptr(), stream) == 0  # the read cleared it
    out = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws)
    assert lib.read_device_error(ws.data_ptr(), stream) == 0
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    assert compare.compare(out, ref).passed


def _fast_path_boxes_expected(b, num_heads: int, num_splits: int) -> int:
    """Blocks of 32 key rows the sm_90a kernel should load through the contiguous fast
    path: in each split's key blocks (the device's schedule: whole pairs of 64-key blocks,
    so only a request's last split can end on an odd block, and the block past it lies
    past the request's keys), every 32-row group of prefix positions whose slots are
    consecutive, once per 64-row query tile of the request."""
    kv_indptr, slots = b.kv_indptr.cpu().tolist(), b.kv_indices.cpu().long()
    total = 0
    for r, n in enumerate(b.n_drafts):
        s = slots[kv_indptr[r] : kv_indptr[r + 1]]
        L = s.numel()
        ntiles = -(-(L + n) // 64)
        splits, per = op.split_plan(L + n, num_splits, 128)
        loaded = []
        for t0 in range(0, 2 * per * splits, 2 * per):
            t1 = min(ntiles, t0 + 2 * per)
            assert t0 < t1  # every split of the plan has keys
            loaded += range(t0, t0 + 2 * ((t1 - t0 + 1) // 2))
        groups = [g for t in loaded for g in (2 * t, 2 * t + 1) if 32 * g + 32 <= L]
        runs = sum(bool((s[32 * g : 32 * g + 32] - s[32 * g] == torch.arange(32)).all()) for g in groups)
        total += runs * -(-n * num_heads // 64)
    return total


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["contiguous", "runs64", "runs16", "fragmented"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_contiguous_fast_path_taken_exactly_on_runs_and_equal_to_the_gather(monkeypatch, layout, num_splits):
    """The contiguous fast path: on sm_90a, a producer warp whose 32 key rows sit in
    consecutive slots loads them with TMA boxes. The workspace count says which blocks
    took it (every 32-aligned run, nothing else); the output is bit-equal to the
    gather's (KDTREE_TMA=0, which the count shows took no fast path), and right."""
    from kdtree_engine.kernel import library

    lib = library.load()
    if not lib.kernel_name(torch.cuda.current_device()).startswith("wgmma-sm90a"):
        pytest.skip("the contiguous fast path is the sm_90a kernel's")
    H = 16
    b = workloads.make_batch([700, 64, 0, 2100], [16, 5, 3, 8], H, layout=layout, seed=9, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    ws = torch.zeros((lib.workspace_bytes(b.q.shape[0] * H, num_splits),), dtype=torch.uint8, device="cuda")
    monkeypatch.delenv("KDTREE_TMA", raising=False)
    fast = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws).clone()
    boxes = lib.read_fast_path_boxes(ws.data_ptr(), stream)
    want = _fast_path_boxes_expected(b, H, num_splits)
    assert boxes == want, (layout, boxes, want)
    if layout in ("contiguous", "runs64"):
        assert want > 0
    monkeypatch.setenv("KDTREE_TMA", "0")
    gather = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws).clone()
    assert lib.read_fast_path_boxes(ws.data_ptr(), stream) == 0
    assert torch.equal(fast, gather)
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    assert compare.compare(fast, ref).passed


def test_drafts_from_the_pool_are_checked():
    """k_ext None needs draft_slots (the drafts' pool slots, one per draft token), and not both."""
    a = _args(_batch())
    slots = torch.arange(a["q"].shape[0])
    with pytest.raises(VerifyArgumentError, match=r"'k_ext': expected the drafts' latents"):
        op.check_arguments(VerifyArgs(**{**a, "k_ext": None}), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match=r"'draft_slots': expected .* slot ids"):
        op.check_arguments(VerifyArgs(**{**a, "k_ext": None}, draft_slots=slots[:-1]), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match=r"'draft_slots': expected dtype"):
        op.check_arguments(VerifyArgs(**{**a, "k_ext": None}, draft_slots=slots.float()), require_cuda=False)
    with pytest.raises(VerifyArgumentError, match=r"'k_ext': expected None when draft_slots"):
        op.check_arguments(VerifyArgs(**a, draft_slots=slots), require_cuda=False)
    shapes = op.check_arguments(VerifyArgs(**{**a, "k_ext": None}, draft_slots=slots), require_cuda=False)
    assert shapes.total_tokens == a["q"].shape[0]


def _planned_batch(lib, target, lens, ns, H, seed):
    """A batch on the GPU, the grid's num_splits the host picks for it, and op.batch_plan's
    (splits, slot) per request under the budget kdtree_verify.cu gives the call (one CTA per
    SM, at most the workspace's partial rows at PLAN_BM a CTA) and the kernel's split step."""
    dev = torch.cuda.current_device()
    b = workloads.make_batch(lens, ns, H, seed=seed, device="cuda")
    T, bs = b.q.shape[0], len(lens)
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    num_splits = choose_num_splits(bs, max(ns), H, sm_count, op.PLAN_BM)
    budget = op.split_budget(bs, T * H, num_splits, sm_count, bs * -(-max(ns) * H // op.PLAN_BM))
    assert budget > 0  # the call takes the batch schedule
    sm90 = target == "native" and lib.kernel_name(dev).startswith("wgmma")
    return b, num_splits, op.batch_plan(lens, ns, H, 128 if sm90 else 32, budget)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_batch_schedule_gives_a_long_request_the_idle_ctas(monkeypatch, target):
    """Ragged batches: one long request among short ones takes far more splits than
    the grid's num_splits (the batch schedule, csrc/common.cuh batch_plan), in both kernels.
    The (slot, splits) pairs the requests' first CTAs leave in the workspace for the combine
    are exactly op.batch_plan's; the output matches the reference. KDTREE_SCHED=grid (the 3-D
    grid of split_plan) writes no pair, and matches the reference too. The workspace past its
    header starts as 0xFF bytes, so a pair or a partial read before it was written shows."""
    from kdtree_engine.kernel import library

    _target_or_skip(target)
    lib = library.load()
    lens, ns, H = [20000, 300, 0, 1000, 300, 2500], [16, 16, 5, 16, 1, 9], 8
    b, num_splits, want = _planned_batch(lib, target, lens, ns, H, seed=31)
    T, bs = b.q.shape[0], len(lens)
    assert want[0][0] > num_splits  # the case is one the 3-D grid caps
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    ws = torch.full((lib.workspace_bytes(T * H, num_splits),), 0xFF, dtype=torch.uint8, device="cuda")
    ws[: op.WS_HEADER].zero_()
    plan = op.workspace_layout(T * H, num_splits)["plan"]
    meta = ws[plan : plan + 8 * bs].view(torch.int32).view(bs, 2)  # Params::plan_meta
    monkeypatch.delenv("KDTREE_SCHED", raising=False)
    out = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws, target=target).clone()
    assert [(sp, slot) for slot, sp in meta.cpu().tolist()] == want
    assert compare.compare(out, ref).passed
    ws[op.WS_HEADER :].fill_(0xFF)
    monkeypatch.setenv("KDTREE_SCHED", "grid")
    grid = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws, target=target)
    assert (meta == -1).all()
    assert compare.compare(grid, ref).passed
    assert lib.read_device_error(ws.data_ptr(), torch.cuda.current_stream().cuda_stream) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
@pytest.mark.parametrize("case", ["chunks", "past-k-squared"])
def test_the_pieces_combine_merges_a_long_row_in_chunks(target, case):
    """The batch schedule's narrow combine (csrc/combine.cuh combine_pieces_kernel) cuts a long
    row into chunks of op.piece_splits splits, merged by several groups at once. A row of at
    most op.COMBINE_GROUPS chunks has them in the groups of one CTA, which merge through shared
    memory and leave the row's counter alone (0, as the main kernel zeroed it); a longer row's
    chunks count themselves in on it and the last group to arrive merges their results, so
    after the call it holds C. `chunks`: one 64k request among seven 1k ones (57 splits in 8
    chunks: one CTA a row); `past-k-squared`: 40 requests of 4 drafts x 16 heads, one of them
    64k (more chunks than a piece's splits: the counted path, whose last group walks them). The
    workspace starts as 0xFF bytes past its header, so an unzeroed counter or an unwritten
    partial shows; the output matches the reference."""
    from kdtree_engine.kernel import library

    _target_or_skip(target)
    lib = library.load()
    if case == "chunks":
        lens, ns, H = [65536] + [1024] * 7, [16] * 8, 8
    else:
        lens, ns, H = [65536] + [100] * 39, [4] * 40, 16
    b, num_splits, plan = _planned_batch(lib, target, lens, ns, H, seed=37)
    T = b.q.shape[0]
    k = op.piece_splits(num_splits)
    chunks = [-(-sp // k) for sp, _ in plan]
    assert chunks[0] > 1 and (chunks[0] > k) == (case == "past-k-squared"), (plan[0], k)
    assert (chunks[0] > op.COMBINE_GROUPS) == (case == "past-k-squared"), (plan[0], op.COMBINE_GROUPS)
    lay = op.workspace_layout(T * H, num_splits)
    assert lay["end"] == lib.workspace_bytes(T * H, num_splits)
    ws = torch.full((lay["end"],), 0xFF, dtype=torch.uint8, device="cuda")
    ws[: op.WS_HEADER].zero_()
    out = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws, target=target)
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    assert compare.compare(out, ref).passed
    cnt = ws[lay["counters"] : lay["end"]].view(torch.int32).cpu()
    for i, ((sp, slot), c) in enumerate(zip(plan, chunks, strict=True)):
        if sp > 1:
            rows = ns[i] * H
            want = c if c > op.COMBINE_GROUPS else 0  # counted only past one CTA's groups
            assert (cnt[slot : slot + rows] == want).all(), (i, sp, c, cnt[slot : slot + rows].unique())
    assert lib.read_device_error(ws.data_ptr(), torch.cuda.current_stream().cuda_stream) == 0


def test_the_workspace_layout_mirrors_the_library():
    """op.workspace_layout's end is the library's kdtree_workspace_bytes, whatever the split count."""
    from kdtree_engine.kernel import library

    try:  # by path: the process's default library (library._default) stays unresolved for later tests
        lib = library.load(library.default_library_path())
    except library.KernelLibraryError as e:  # none built on this machine
        pytest.skip(f"no kernel library: {e}")
    for rows, splits in [(128, 2), (1024, 8), (2560, 3), (7, 65)]:
        lay = op.workspace_layout(rows, splits)
        assert lay["end"] == lib.workspace_bytes(rows, splits)
        assert lay["plan"] < lay["parts"] < lay["lse"] < lay["counters"] < lay["end"]


def test_the_batch_schedule_budget_takes_every_sm_where_the_wave_rounds_down():
    """op.split_budget (csrc/kdtree_verify.cu's rule): the workspace holds WS_PART_FACTOR times
    the grid's partial rows, so a batch whose grid choose_num_splits rounds down (bs32 N8 H16:
    64 row tiles, 2 splits, 128 CTAs of partial rows at one factor) shares all 132 SMs, and the
    schedule's partial rows (at most PLAN_BM a CTA) still fit op.workspace_layout's partials."""
    bs, n, H = 32, 8, 16
    ns = choose_num_splits(bs, n, H, 132, op.PLAN_BM)
    assert ns == 2 and bs * n * H * ns // op.PLAN_BM == 128
    budget = op.split_budget(bs, bs * n * H, ns, 132, bs * 2)
    assert budget == 132
    lay = op.workspace_layout(bs * n * H, ns)
    assert budget * op.PLAN_BM * op.V_DIM * 2 <= lay["lse"] - lay["parts"]
    assert op.split_budget(1, 128, 66, 132, 2) == 0  # one request: the 3-D grid


def test_the_batch_schedule_model_keeps_uniform_counts_and_fits_its_budget():
    """op.batch_plan (the device's rule, which the GPU test above checks the kernels against):
    a uniform batch takes split_plan's counts under the grid the host sizes for it; a ragged
    one gives its long request more splits than that grid's and never exceeds the budget; the
    partial rows are packed request by request (one split: none)."""
    for bs, n, H, L in [(8, 16, 8, 32768), (32, 8, 16, 8192), (64, 4, 16, 4096), (4, 32, 16, 32768)]:
        ns = choose_num_splits(bs, n, H, 132, op.PLAN_BM)
        plan = op.batch_plan([L] * bs, [n] * bs, H, 128, min(132, bs * n * H * ns // op.PLAN_BM))
        sp = op.split_plan(L + n, ns, 128)[0]
        assert [s for s, _ in plan] == [sp] * bs, (bs, n, H, L)
        assert [slot for _, slot in plan] == [i * sp * n * H for i in range(bs)]
    lens, ns = [65536] + [1024] * 7, [16] * 8
    plan = op.batch_plan(lens, ns, 8, 128, 128)
    assert plan[0][0] > choose_num_splits(8, 16, 8, 132, op.PLAN_BM) and all(s == 1 for s, _ in plan[1:])
    assert sum(2 * s for s, _ in plan) <= 128
    assert [slot for _, slot in plan[1:]] == [plan[0][0] * 16 * 8] * 7


# --- the step plan (op.VerifyPlan, csrc/plan.cu) -------------------------------------------


def test_plan_arguments_are_checked_before_anything_runs():
    """make_plan needs a plan, plan must be a VerifyPlan, make_plan a bool; nothing launches
    (a CPU batch: the checks come before the device is needed)."""
    a = _args(_batch())
    with pytest.raises(VerifyArgumentError, match="'plan': expected a VerifyPlan to make"):
        op.verify_attention(**a, make_plan=True)
    with pytest.raises(VerifyArgumentError, match="'plan': expected a VerifyPlan or None, got bytes"):
        op.verify_attention(**a, plan=b"plan")
    with pytest.raises(VerifyArgumentError, match="'make_plan': expected a bool, got 1"):
        op.verify_attention(**a, make_plan=1)


def _unpack_jobs(plan: op.VerifyPlan, budget: int) -> list[tuple[int, int, int, int]]:
    """(b, local, splits, rows) of each CTA's job in the plan buffer (csrc/common.cuh pack_job)."""
    jobs = plan.buffer[32 : 32 + 16 * budget].view(torch.int32).view(budget, 4).cpu().tolist()
    return [((x & 255) - 1, x >> 8, y & 2047, (y >> 11) - 1) for x, y, _, _ in jobs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_a_plan_made_once_runs_the_steps_calls_like_the_derived_schedule(monkeypatch, target):
    """The plan kernel writes every CTA's job: request by request, row tile fastest, each
    request's row tiles x splits of op.batch_plan; a call that reads it leaves the same
    (slot, splits) pairs for the combine as a call that derives its schedule, and the same
    output, bit for bit. The workspaces start as 0xFF bytes past their headers."""
    from kdtree_engine.kernel import library

    _target_or_skip(target)
    monkeypatch.delenv("KDTREE_SCHED", raising=False)
    lib = library.load()
    lens, ns, H = [20000, 300, 0, 1000, 300, 2500], [16, 16, 5, 16, 1, 9], 8
    b, num_splits, want = _planned_batch(lib, target, lens, ns, H, seed=41)
    T, bs = b.q.shape[0], len(lens)
    ref, _ = reference.verify_attention_ref(*b.ref_args())
    stream = torch.cuda.current_stream().cuda_stream
    lay = op.workspace_layout(T * H, num_splits)

    def workspace() -> torch.Tensor:
        ws = torch.full((lay["end"],), 0xFF, dtype=torch.uint8, device="cuda")
        ws[: op.WS_HEADER].zero_()
        return ws

    def meta(ws: torch.Tensor) -> list[tuple[int, int]]:
        return [(sp, slot) for slot, sp in ws[lay["plan"] : lay["plan"] + 8 * bs].view(torch.int32).view(bs, 2).cpu().tolist()]

    ws0 = workspace()
    derived = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws0, target=target).clone()
    plan = op.VerifyPlan()
    ws1 = workspace()
    made = op.verify_attention(*b.kernel_args(), num_splits=num_splits, workspace=ws1, target=target, plan=plan,
                               make_plan=True).clone()
    assert plan.key == (op.TARGETS[target], bs, H, max(ns), T, num_splits)
    ws2 = workspace()
    used = op.verify_attention(*b.kernel_args(), workspace=ws2, target=target, plan=plan)
    assert meta(ws0) == meta(ws1) == meta(ws2) == want
    assert torch.equal(made, derived) and torch.equal(used, derived)
    assert compare.compare(used, ref).passed
    budget = op.split_budget(bs, T * H, num_splits, torch.cuda.get_device_properties(0).multi_processor_count,
                             bs * -(-max(ns) * H // op.PLAN_BM))
    expect = []
    for i, (sp, _) in enumerate(want):
        rows = ns[i] * H
        expect += [(i, j, sp, rows) for j in range(-(-rows // op.PLAN_BM) * sp)] if rows else []
    jobs = _unpack_jobs(plan, budget)
    assert jobs[: len(expect)] == expect and all(j[0] == -1 for j in jobs[len(expect) :])
    for ws in (ws0, ws1, ws2):
        assert lib.read_device_error(ws.data_ptr(), stream) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_plan_of_another_shape_is_refused_before_launch():
    """The host keeps the making call's shape: a call of another shape (or before any making
    call) is refused, naming the plan and both shapes, and its output is left alone."""
    b = workloads.make_batch([3000, 500], [16, 16], 8, seed=43, device="cuda")
    other = workloads.make_batch([3000, 500, 10], [16, 16, 16], 8, seed=44, device="cuda")
    plan = op.VerifyPlan()
    out = torch.full((32, 8, 512), 3.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(VerifyArgumentError, match=r"'plan': .*got one made for nothing \(never made\)"):
        op.verify_attention(*b.kernel_args(), out=out, plan=plan)
    op.verify_attention(*other.kernel_args(), plan=plan, make_plan=True)
    with pytest.raises(VerifyArgumentError, match=r"'plan': .*bs=2 .*got one made for bs=3 "):
        op.verify_attention(*b.kernel_args(), out=out, plan=plan)
    with pytest.raises(VerifyArgumentError, match=r"'num_splits': expected the plan's"):
        op.verify_attention(*other.kernel_args(), plan=plan, num_splits=plan.key[5] + 1)
    assert bool((out == 3.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_a_plan_read_with_other_lengths_sets_the_plan_bit(monkeypatch, target):
    """The lengths live on the device: a call of the plan's shape whose lengths differ from the
    making call's reads a schedule made for others. Its CTAs compare their request's rows and
    splits with their job's and skip a mismatch, the combine compares each request's rows, and
    both set KDTREE_ERR_PLAN (16), which KDTREE_DEBUG=1 raises. A plan whose header names
    another shape (written over here: the host refuses such a call) is not read at all: the call
    derives its schedule, sets the bit, and its output is right."""
    from kdtree_engine.kernel import library

    _target_or_skip(target)
    monkeypatch.delenv("KDTREE_DEBUG", raising=False)
    monkeypatch.delenv("KDTREE_SCHED", raising=False)
    lib = library.load()
    stream = torch.cuda.current_stream().cuda_stream
    a = workloads.make_batch([9000, 300, 2000], [16, 16, 16], 8, seed=45, device="cuda")
    b = workloads.make_batch([300, 9000, 2000], [16, 16, 16], 8, seed=46, device="cuda")
    plan = op.VerifyPlan()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    ns = choose_num_splits(3, 16, 8, sm, op.PLAN_BM)
    ws = torch.zeros(lib.workspace_bytes(48 * 8, ns), dtype=torch.uint8, device="cuda")
    op.verify_attention(*a.kernel_args(), plan=plan, make_plan=True, workspace=ws, num_splits=ns, target=target)
    assert lib.read_device_error(ws.data_ptr(), stream) == 0
    op.verify_attention(*b.kernel_args(), plan=plan, workspace=ws, target=target)
    assert lib.read_device_error(ws.data_ptr(), stream) == 16
    monkeypatch.setenv("KDTREE_DEBUG", "1")
    with pytest.raises(RuntimeError, match="step plan was made for another batch shape or other lengths"):
        op.verify_attention(*b.kernel_args(), plan=plan, workspace=ws, target=target)
    monkeypatch.delenv("KDTREE_DEBUG")
    plan.buffer[4:8].view(torch.int32).fill_(4)  # the header's bs: a plan for 4 requests
    out = op.verify_attention(*a.kernel_args(), plan=plan, workspace=ws, target=target)
    assert lib.read_device_error(ws.data_ptr(), stream) == 16
    ref, _ = reference.verify_attention_ref(*a.ref_args())
    assert compare.compare(out, ref).passed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target", ["native", "sm_120"])
def test_a_captured_step_plans_from_the_lengths_each_replay_replays(target):
    """As the SGLang plugin runs a step under CUDA-graph capture: the first layer's call makes
    the plan (its plan kernel is captured with it), the second layer's reads it. Replays with
    other lengths written into the same buffers match the reference in both layers, with no
    plan error: each replay planned from its own lengths."""
    from kdtree_engine.kernel import library
    from kdtree_pipeline.graph.capture import capture_graph
    from kdtree_pipeline.graph.gate import _step

    _target_or_skip(target)
    heads, n = 8, 16
    sm_scale = workloads.DEEPSEEK_SM_SCALE
    pool, vg = _verify_graph(heads, n, max_bs=3, max_prefix=6000, seed=5)
    plan = op.VerifyPlan()
    out2 = torch.empty_like(vg.out)

    def step() -> None:  # two layers of one verify step, no host hint
        for out, make in ((vg.out, True), (out2, False)):
            op.verify_attention(vg.q, vg.k_ext, vg.kv_buffer, vg.qo_indptr, vg.kv_indptr, vg.kv_indices,
                                vg.custom_mask, vg.mask_indptr, sm_scale, n, out=out, target=target, plan=plan,
                                make_plan=make)

    vg.load(_step(pool, [1000, 1000, 1000], n, heads, "eagle", 1, sm_scale))
    graph, _ = capture_graph(step)
    lib = library.load()
    for i, lens in enumerate(([6000, 100, 2000], [0, 5000, 5000], [300, 300, 300], [6000, 6000, 1])):
        b = _step(pool, lens, n, heads, "eagle", 20 + i, sm_scale)
        vg.load(b)
        vg.out.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference.verify_attention_ref(*b.ref_args())
        T = b.bs * n
        for o in (vg.out, out2):
            d = compare.compare(o[:T], ref)
            assert d.passed, (lens, d)
    ws = op._workspaces.get(vg.q.device, 0)
    assert lib.read_device_error(ws.data_ptr(), torch.cuda.current_stream().cuda_stream) == 0
