"""The build gate's reading of ptxas -v output (CPU only: a recorded log, no nvcc)."""

from pathlib import Path

from kdtree_engine.kernel.build import BuildResult, parse_ptxas, serialized, spills

# Shaped like nvcc 13.0's ptxas -v output: module-level notes come before the
# "Compiling entry function" lines of the arch they belong to.
LOG = """\
ptxas info    : (C7519) warpgroup.arrive is injected in around line 14394 by compiler to allow use of registers in GMMA in function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE'
{serial}ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_ZN6kdtree19combine_wide_kernelILi8EEEvNS_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN6kdtree19combine_wide_kernelILi8EEEvNS_6ParamsE
    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads
ptxas info    : Used 60 registers, used 1 barriers, 18560 bytes smem
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_ZN6kdtree18verify_attn_kernelILi4EEEvNS_6ParamsE' for 'sm_120'
ptxas info    : Function properties for _ZN6kdtree18verify_attn_kernelILi4EEEvNS_6ParamsE
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers
"""
SERIAL = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
          "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
          "stage in the function '_ZN6kdtree4sm9023verify_attn_kernel_sm90ENS_6ParamsE'\n")


def _result(log: str) -> BuildResult:
    return BuildResult(Path("lib.so"), True, ["sm_90a", "sm_120"], [], "13.0", parse_ptxas(log), {}, log)


def test_clean_log_names_every_kernel_per_arch():
    k = parse_ptxas(LOG.format(serial="", spill=0))
    assert k["sm_90a"]["verify_attn_kernel_sm90"]["registers"] == 168
    assert k["sm_90a"]["combine_wide_kernel<8>"]["registers"] == 60
    assert k["sm_120"]["verify_attn_kernel<4>"]["registers"] == 254
    res = _result(LOG.format(serial="", spill=0))
    assert spills(res) == [] and serialized(res) == []


def test_serialized_wgmma_is_reported_for_the_arch_that_follows():
    res = _result(LOG.format(serial=SERIAL, spill=0))
    assert serialized(res) == ["verify_attn_kernel_sm90 on sm_90a"]
    assert "wgmma_serialized" not in res.kernels["sm_120"].get("verify_attn_kernel_sm90", {})


def test_spills_are_reported():
    res = _result(LOG.format(serial="", spill=32))
    assert spills(res) == ["combine_wide_kernel<8> on sm_90a: 32 B spill stores, 32 B spill loads"]
