"""The ``build`` gate: compile ``csrc/`` for every target arch and prove the build fit to ship.

    python -m kdtree_pipeline build [--arch sm_90 --arch sm_120a] [--force] [--out DIR]

Runs :func:`kdtree_engine.kernel.build.build` and fails on a missing nvcc, a compile
error (the compiler's own message is printed), any spill, a wgmma pipeline that ptxas
serialized, or an sm_120 configuration that does not fit sm_120's limits
(:func:`sm120_fit`). The evidence counts the tensor-core and async-copy instructions in
each arch's SASS where cuobjdump is available.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kdtree_engine.kernel import library as L
from kdtree_engine.kernel.build import (
    BuildError,
    BuildResult,
    build,
    instances,
    serialized,
    spills,
)
from kdtree_pipeline import evidence

#: what the kernel/tile choice reads of an sm_120 GPU, the RTX PRO 6000 Blackwell: CC 12.0, 188 SMs
#: (NVIDIA's launch specifications), and from CCCL's arch_traits.h (traits<id::sm_120>) 1536 threads,
#: 99 KB of opt-in shared memory per block (the 100 KB of an SM less 1 KB reserved per block), 100 KB per SM
SM120_PROPS = (12, 0, 188, 1536, 99 * 1024, 100 * 1024)
#: tile -> the kernel function that runs it (as parse_ptxas names it)
TILE_KERNELS = {1: "verify_attn_kernel_sm90", 2: "verify_attn_kernel_mma_qreg"}


#: the H200 whose sm_120 emulation must choose what an sm_120 GPU gets: CC 9.0, 132 SMs, 2048
#: threads, 227 KB per block, 228 KB per SM
H200_PROPS = (9, 0, 132, 2048, 227 * 1024, 228 * 1024)
#: registers per SM on sm_120
SM120_REGISTERS = 64 * 1024


def _emulation_problems(lib: L.Library, cfg: L.KdtreeConfig, flags: int) -> list[str]:
    """The sm_120 emulation on an H200 must run what an sm_120 GPU runs (kernel, tile, CTAs per SM)."""
    rc, emu = lib.choose_config(L.KdtreeDeviceProps(*H200_PROPS), L.TARGET_SM120, flags)
    if rc != L.OK or (emu.kernel, emu.tile, emu.ctas_per_sm) != (cfg.kernel, cfg.tile, cfg.ctas_per_sm):
        return [f"the sm_120 emulation on an H200 chooses otherwise ({emu.as_dict()}) than sm_120 ({cfg.as_dict()})"]
    return []


def _tile_problems(c: dict) -> list[str]:
    problems = []
    limit = SM120_PROPS[4]
    if c["smem_bytes"] > limit:
        problems.append(f"sm_120 tile {c['name']} takes {c['smem_bytes']} B of shared memory; sm_120 allows {limit}")
    if c["ctas_per_sm"] < 1:
        problems.append(f"sm_120 tile {c['name']} fits no CTA per SM")
    return problems


def _kernel_problems(found: dict[str, dict], kname: str | None, c: dict) -> list[str]:
    """ptxas's report of each instance of the tile's kernel in the sm_120 code, against sm_120's
    registers per SM and with no spill."""
    if not found:
        return [f"ptxas reported no {kname} for sm_120 (the kernel of tile {c['name']})"]
    problems = []
    for inst, k in found.items():
        regs = k.get("registers") or 0
        if regs * c["threads"] * c["ctas_per_sm"] > SM120_REGISTERS:
            problems.append(f"{inst}: {regs} registers x {c['threads']} threads x {c['ctas_per_sm']} CTAs exceed "
                            "sm_120's 64K registers per SM")
        if k.get("spill_stores") or k.get("spill_loads"):
            problems.append(f"{inst} spills on sm_120")
    return problems


def sm120_fit(result: BuildResult) -> tuple[dict, list[str]]:
    """Does every configuration an sm_120 GPU gets fit sm_120's limits? Asks the built
    library's own choice (kdtree_choose_config: no GPU needed) for an sm_120 device, and
    for the sm_120 emulation on an H200, then checks the chosen tile against the limits
    and against ptxas's report of that kernel in the sm_120 code."""
    arch = next((a for a in ("sm_120a", "sm_120") if a in result.archs), None)
    if arch is None:
        return {}, []
    try:
        lib = L.Library(result.library)
    except Exception as e:  # noqa: BLE001 - reported as the gate's reason
        return {}, [f"cannot load {result.library.name} to ask its sm_120 configuration: {e}"]
    flags = L.CFG_HAS_SM90A if "sm_90a" in result.archs else 0
    rc, cfg = lib.choose_config(L.KdtreeDeviceProps(*SM120_PROPS), L.TARGET_NATIVE, flags)
    if rc != L.OK:
        return {}, [f"no sm_120 configuration: {cfg.note.decode()}"]
    c = cfg.as_dict()
    kname = TILE_KERNELS.get(c["tile"])
    found = instances(result.kernels.get(arch, {}), kname or "?")  # the 3-D grid's and the batch schedule's
    problems = _emulation_problems(lib, cfg, flags) + _tile_problems(c) + _kernel_problems(found, kname, c)
    hg = result.sass.get(arch, {}).get("HGMMA", 0)
    if hg:
        problems.append(f"sm_120 code holds {hg} HGMMA (wgmma): an instruction sm_120 lacks")
    fit = {"tile": c["name"], "kernel": kname, "smem_bytes": c["smem_bytes"], "smem_limit": SM120_PROPS[4],
           "threads": c["threads"], "ctas_per_sm": c["ctas_per_sm"],
           "registers": max((k.get("registers") or 0 for k in found.values()), default=None)}
    return fit, problems


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kdtree_pipeline build", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="target arch (repeatable or comma list); default sm_90a,sm_120a")
    ap.add_argument("--force", action="store_true", help="rebuild even when sources and flags are unchanged")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default build/lib)")
    return ap


def unfit_reason(res: BuildResult, fit_problems: list[str]) -> str | None:
    """Why the build is unfit to ship, the first of: sm_120's limits, a spill, a serialized
    wgmma pipeline, an arch ptxas reported nothing for; None when it is fit."""
    if fit_problems:
        return "sm_120 limits: " + "; ".join(fit_problems)
    bad = spills(res)
    if bad:
        return "register spills: " + "; ".join(bad)
    serial = serialized(res)
    if serial:
        return ("wgmma serialized by ptxas (C7514: an accumulator touched while its MMA is in flight; C7520: a "
                "pipeline across a divergent branch): " + "; ".join(serial))
    missing = [a for a in res.archs if a not in res.kernels and res.rebuilt]
    if missing:
        return f"ptxas reported no kernels for {missing}"
    return None


def headline_of(res: BuildResult, fit: dict) -> str:
    """The passing build's one line: archs and nvcc, registers per arch, SASS MMA counts, the sm_120 fit."""
    regs = {a: [v.get("registers") or 0 for v in ks.values()] for a, ks in res.kernels.items()}
    headline = f"{','.join(res.archs)} built with nvcc {res.nvcc}; " + ", ".join(
        f"{a}: {max(regs[a]) if regs.get(a) else '?'} regs max, 0 spills" for a in res.archs)
    mma = {a: (c.get("HMMA", 0) + c.get("HGMMA", 0)) for a, c in res.sass.items()}
    if mma:
        headline += "; SASS MMA " + ", ".join(f"{a}={n}" for a, n in mma.items())
    else:
        headline += "; SASS not counted (no cuobjdump)"
    if fit:
        headline += (f"; sm_120 tile {fit['tile']} fits sm_120 ({fit['smem_bytes'] / 1024:.1f} of "
                     f"{fit['smem_limit'] // 1024} KB, {fit['ctas_per_sm']} CTA/SM, {fit['registers']} regs x "
                     f"{fit['threads']} threads)")
    return headline


def _report(res: BuildResult, reason: str | None, path: Path) -> None:
    print(f"build: {res.library} ({'rebuilt' if res.rebuilt else 'up to date'})")
    for a, ks in res.kernels.items():
        for k, v in ks.items():
            print(f"  {a:7s} {k:24s} {v.get('registers', '?'):>4} regs  spills {v.get('spill_stores', 0)}/{v.get('spill_loads', 0)} B")
    for a, c in res.sass.items():
        print(f"  {a:7s} SASS: " + " ".join(f"{f}={n}" for f, n in c.items() if n))
    print(f"build: {'PASS' if reason is None else 'FAIL: ' + str(reason)}  (evidence {path})")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        res = build(args.arch, args.out, args.force)
    except BuildError as e:
        print(f"build: FAILED: {e}", file=sys.stderr)
        rec = evidence.make_record("build", False, {}, "build failed", reason=str(e).splitlines()[0], device=None)
        evidence.write_record(rec)
        return 1
    fit, fit_problems = sm120_fit(res)
    reason = unfit_reason(res, fit_problems)
    metrics = {"archs": res.archs, "nvcc": res.nvcc, "flags": res.flags, "library": str(res.library),
               "library_bytes": res.library.stat().st_size, "rebuilt": res.rebuilt, "kernels": res.kernels,
               "sass": res.sass, "sm120_fit": fit}
    rec = evidence.make_record("build", reason is None, metrics,
                               headline_of(res, fit) if reason is None else "build failed", reason=reason, device=None)
    _report(res, reason, evidence.write_record(rec))
    return 0 if reason is None else 1

if __name__ == "__main__":
    sys.exit(main())
