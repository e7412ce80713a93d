"""The kernel/tile choice (csrc/config.cc): a pure function of device properties.

CPU only: config.cc is compiled alone with the host C++ compiler (no nvcc, no GPU) and
called through the same ctypes structures the library binding uses. The property sets
are those the CUDA runtime reports for each GPU (compute capability, opt-in shared
memory per block, shared memory per SM, SM count, threads per SM).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kdtree_engine.kernel import library as L

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KB = 1024

#: (cc major, cc minor, SMs, threads per SM, opt-in smem per block, smem per SM)
RTX_PRO_6000 = (12, 0, 188, 1536, 99 * KB, 100 * KB)   # sm_120
H200 = (9, 0, 132, 2048, 227 * KB, 228 * KB)           # sm_90
L40S = (8, 9, 142, 1536, 99 * KB, 100 * KB)            # sm_89
A100 = (8, 0, 108, 2048, 163 * KB, 164 * KB)           # sm_80
T4 = (7, 5, 40, 1024, 64 * KB, 64 * KB)                # sm_75


@pytest.fixture(scope="module")
def choose(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no host C++ compiler")
    so = tmp_path_factory.mktemp("cfg") / "libcfg.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(CSRC), str(CSRC / "config.cc"), "-o", str(so)],
                   check=True, capture_output=True, text=True)
    fn = L.bind_choose_config(ctypes.CDLL(str(so)))

    def call(props, target=L.TARGET_NATIVE, flags=L.CFG_HAS_SM90A, tile=0):
        p = L.KdtreeDeviceProps(props[0], props[1], props[2], props[3], props[4], props[5])
        cfg = L.KdtreeConfig()
        rc = fn(ctypes.byref(p), target, flags, tile, ctypes.byref(cfg))
        return rc, cfg.as_dict()

    return call


def test_sm120_gets_the_qreg_tile_one_cta_per_sm(choose):
    rc, c = choose(RTX_PRO_6000)
    assert rc == L.OK, c["note"]
    # 8 math warps and a producer warpgroup
    assert (c["kernel"], c["tile"], c["block_rows"], c["threads"]) == (L.KERNEL_MMA, L.TILE_MMA_64X32_QREG, 64, 384)
    assert c["smem_bytes"] <= 99 * KB and c["smem_request"] == c["smem_bytes"]
    assert c["ctas_per_sm"] == 1 and not c["emulated"] and c["target_cc"] == 120


def test_a_real_sm120_ignores_the_emulation_switch(choose):
    assert choose(RTX_PRO_6000, L.TARGET_SM120) == choose(RTX_PRO_6000)


def test_sm90_gets_the_wgmma_kernel_unless_forced_or_built_without_sm90a(choose):
    rc, c = choose(H200)
    assert rc == L.OK and (c["kernel"], c["tile"], c["threads"]) == (L.KERNEL_SM90, L.TILE_SM90_64X64, 384)
    assert c["smem_bytes"] <= 227 * KB and c["ctas_per_sm"] == 1
    for flags in (0, L.CFG_HAS_SM90A | L.CFG_FORCE_MMA):
        rc, c = choose(H200, flags=flags)
        assert rc == L.OK and (c["kernel"], c["tile"]) == (L.KERNEL_MMA, L.TILE_MMA_64X32_QREG)
        assert c["ctas_per_sm"] == 2  # 98 KB: two fit in 228 KB


def test_sm120_emulation_on_sm90_is_sm120s_choice_with_its_occupancy(choose):
    rc, native = choose(RTX_PRO_6000)
    rc, c = choose(H200, L.TARGET_SM120)
    assert rc == L.OK, c["note"]
    assert c["emulated"] == 1 and c["target_cc"] == 120
    for k in ("kernel", "tile", "block_rows", "threads", "smem_bytes", "ctas_per_sm"):
        assert c[k] == native[k], k
    # padded so that the H200 holds no more CTAs per SM than sm_120 does ...
    per_block = c["smem_request"] + KB
    assert H200[5] // per_block == native["ctas_per_sm"]
    # ... and no more than needed for that
    assert H200[5] // (per_block - 1024) > native["ctas_per_sm"]
    assert c["smem_request"] <= H200[4]
    assert "sm_120 emulation" in c["name"]


def test_sm89_and_sm80_take_the_portable_kernel(choose):
    for props, ctas in ((L40S, 1), (A100, 1)):
        rc, c = choose(props)
        assert rc == L.OK and (c["kernel"], c["tile"]) == (L.KERNEL_MMA, L.TILE_MMA_64X32_QREG)
        assert c["smem_bytes"] <= props[4] and c["ctas_per_sm"] == ctas


def test_emulation_below_cc90_is_refused_with_the_reason(choose):
    for props in (L40S, A100):
        rc, c = choose(props, L.TARGET_SM120)
        assert rc == L.EINVAL
        assert "compute capability >= 9.0" in c["note"] and f"{props[0]}.{props[1]}" in c["note"]


def test_devices_below_sm80_get_no_kernel(choose):
    rc, c = choose(T4)
    assert rc == L.ENOARCH and "8.0" in c["note"]


def test_bad_target_tile_and_properties_are_refused(choose):
    rc, c = choose(H200, target=89)
    assert rc == L.EINVAL and "got 89" in c["note"]
    rc, c = choose(H200, tile=L.TILE_SM90_64X64)
    assert rc == L.EINVAL and "portable" in c["note"]
    rc, c = choose(RTX_PRO_6000, tile=7)
    assert rc == L.EINVAL and "tile 7" in c["note"]
    rc, c = choose((12, 0, 188, 1536, 64 * KB, 100 * KB))  # a device whose blocks take less than the tile
    assert rc == L.EINVAL and "allows 65536" in c["note"]
    rc, c = choose((9, 0, 0, 2048, 227 * KB, 228 * KB))
    assert rc == L.EINVAL and "0 SMs" in c["note"]


def test_every_tile_fits_one_cta_on_the_device_that_picks_it(choose):
    for props in (RTX_PRO_6000, H200, L40S, A100):
        for target in (L.TARGET_NATIVE, L.TARGET_SM120):
            rc, c = choose(props, target)
            if rc != L.OK:
                continue
            limit = 99 * KB if c["target_cc"] == 120 else props[4]
            assert c["smem_bytes"] <= limit and c["ctas_per_sm"] >= 1
