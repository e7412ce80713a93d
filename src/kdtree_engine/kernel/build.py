"""The ``build`` gate: compile ``csrc/`` with nvcc into one shared library.

    python -m kdtree_engine build [--arch sm_90 --arch sm_120a] [--force] [--out DIR]

One ``-gencode`` per target arch, a static CUDA runtime (so the library loads
through ctypes in any Python), ``-Xptxas -v`` for per-kernel registers and
spills, and a stamp (sources + flags + nvcc version) so that an unchanged tree
is not rebuilt. The stamp also names the csrc/ hash and the library's sha256: a GPU
gate's evidence says which library it ran and whether this tree built it
(kernel.library.provenance), and a plan records no GPU proof of a library that
another tree built. The gate fails on a missing nvcc, a compile error (the
compiler's own message is printed), any spill (no kernel here declares one) or
a wgmma pipeline that ptxas serialized (any of its "wgmma.mma_async instructions
are serialized" notes: C7514, a non-wgmma instruction touches an accumulator while
the MMA is in flight; C7520, a wgmma pipeline across a branch ptxas takes for
divergent; the kernel then runs, correct and much slower, which only a benchmark
would otherwise show).
When ``cuobjdump`` is available (``pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm``, the ``build`` extra) the evidence also counts the
tensor-core and async-copy instructions in each arch's SASS.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from kdtree_engine.kernel.library import LIB_NAME, STAMP_SUFFIX  # one spelling of the file names
from kdtree_engine.pipeline import evidence

#: sm_90a = Hopper with its arch-specific instructions (wgmma): the H100/H200 kernel;
#: sm_120a = RTX PRO 6000 Blackwell and RTX 5090, compute capability 12.0 (the mma.sync path; "a"
#: for setmaxnreg, which gives the tile's math warps the producer warpgroup's registers).
#: ``--arch sm_90`` builds the portable path only; generic sm_90 or sm_120 code has no setmaxnreg,
#: so that tile then spills (correct, slower; the build gate reports it).
DEFAULT_ARCHS = ("sm_90a", "sm_120a")
BASE_FLAGS = ["-O3", "-lineinfo", "-std=c++17", "-Xptxas=-v,--warn-on-spills", "-shared",
              "-Xcompiler", "-fPIC", "-cudart", "static"]
#: SASS instruction families worth counting: tensor-core MMA, async copies, shared-memory matrix loads,
#: and local-memory traffic (which should be zero).
SASS_FAMILIES = ("HMMA", "HGMMA", "LDGSTS", "UTMALDG", "LDSM", "LDL", "STL")


class BuildError(RuntimeError):
    """The build cannot run or failed; the message says why."""


@dataclass
class BuildResult:
    library: Path
    rebuilt: bool
    archs: list[str]
    flags: list[str]
    nvcc: str
    kernels: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # arch -> kernel -> regs/spills
    sass: dict[str, dict[str, int]] = field(default_factory=dict)  # arch -> family -> count
    log: str = ""


def default_out_dir(root: Path | None = None) -> Path:
    """The library's folder: ``KDTREE_BUILD_DIR`` (an explicit choice wins, as KDTREE_LIB does
    for the file), else build/lib of ``root`` (default: the checkout around the working
    directory). One rule for the build gate, the loader and a record's provenance, so that a
    record names the file the gate loaded."""
    env = os.environ.get("KDTREE_BUILD_DIR")
    if env:
        return Path(env)
    return Path(root or evidence.repo_root()) / "build" / "lib"


def parse_archs(values: list[str] | None) -> list[str]:
    raw = values or os.environ.get("KDTREE_ARCHS", ",".join(DEFAULT_ARCHS)).split(",")
    archs = []
    for v in raw:
        for a in v.split(","):
            a = a.strip()
            if not a:
                continue
            if not re.fullmatch(r"sm_\d{2,3}a?", a):
                raise BuildError(f"--arch: expected names like sm_90, sm_90a or sm_120, got {a!r}")
            if a not in archs:
                archs.append(a)
    if not archs:
        raise BuildError("--arch: no target arch given")
    return archs


def gencode(arch: str) -> str:
    num = arch[3:]
    return f"-gencode=arch=compute_{num},code={arch}"


def find_nvcc() -> str:
    cand = os.environ.get("NVCC") or shutil.which("nvcc")
    if not cand:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        p = Path(home) / "bin" / "nvcc"
        cand = str(p) if p.is_file() else None
    if not cand:
        raise BuildError("nvcc not found: install the CUDA toolkit or set NVCC / CUDA_HOME")
    return cand


def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"cannot run {nvcc} --version: {e}") from None
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out.stdout)
    if out.returncode != 0 or not m:
        raise BuildError(f"{nvcc} --version failed: {out.stdout}{out.stderr}")
    return f"{m.group(1)} ({m.group(2)})"


def sources(root: Path) -> list[Path]:
    csrc = root / "csrc"
    cu = sorted(csrc.glob("*.cu"))
    if not cu:
        raise BuildError(f"no .cu sources in {csrc}")
    return cu + sorted(csrc.glob("*.cc"))  # host-only C++ (config.cc: the kernel/tile choice)


def csrc_hash(root: Path) -> str:
    """sha256 over (path, bytes) of every file under ``root``/csrc: the sources a library is
    compiled from. The build stamp records it, and a gate's evidence compares the library it
    ran against this tree's (kernel.library.provenance)."""
    h = hashlib.sha256()
    for p in sorted((Path(root) / "csrc").rglob("*")):
        if p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _stamp(src_hash: str, flags: list[str], nvcc_v: str) -> str:
    """The build's identity: csrc/'s hash (:func:`csrc_hash`), the flags and nvcc's version."""
    h = hashlib.sha256(src_hash.encode())
    h.update(json.dumps([flags, nvcc_v]).encode())
    return h.hexdigest()


_FUNC_RE = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REG_RE = re.compile(r"Used (\d+) registers")
#: ptxas's "wgmma.mma_async instructions are serialized due to ..." notes, whatever their code
#: (C7514: accumulators read in the pipeline stage; C7520: a divergent path; others alike)
_SERIAL_RE = re.compile(r"\((C75\d\d)\)[^']*wgmma\.mma_async instructions are serialized[^']*function '(\w+)'")


def _short(name: str) -> str:
    """Mangled kernel name -> a readable one (verify_attn_kernel_mma_qreg<true>,
    combine_onepass_kernel<8, 10, false>, combine_wide_kernel, plan_kernel)."""
    m = re.search(r"(verify_attn_kernel\w*?|combine_\w+?_kernel|combine_kernel|clear_error_kernel|plan_kernel)"
                  r"(I((?:L[ib]\d+E)+)E|E|N)", name)
    if not m:
        return name
    if not m.group(3):
        return m.group(1)
    args = ", ".join(v if t == "i" else ("true" if v == "1" else "false")
                     for t, v in re.findall(r"L([ib])(\d+)E", m.group(3)))
    return f"{m.group(1)}<{args}>"


def instances(kernels: dict[str, dict[str, int]], name: str) -> dict[str, dict[str, int]]:
    """The entries of one arch's ptxas report that are kernel ``name``: itself, or any of its
    template instances (``name<...>``)."""
    return {k: v for k, v in kernels.items() if k == name or k.startswith(name + "<")}


def parse_ptxas(log: str) -> dict[str, dict[str, dict[str, int]]]:
    """ptxas -v output -> {arch: {kernel: {registers, stack, spill_stores, spill_loads[, wgmma_serialized]}}}."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    cur: dict[str, int] | None = None
    serial: list[str] = []  # the notes come before the module's "Compiling entry function" lines
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            ks = out.setdefault(m.group(2), {})
            for name in serial:
                ks.setdefault(name, {})["wgmma_serialized"] = 1
            serial = []
            cur = ks.setdefault(_short(m.group(1)), {})
            continue
        m = _SERIAL_RE.search(line)
        if m:
            serial.append(_short(m.group(2)))
            continue
        if cur is None:
            continue
        m = _SPILL_RE.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _REG_RE.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def find_cuobjdump() -> str | None:
    cand = shutil.which("cuobjdump")
    if cand:
        return cand
    purelib = Path(sysconfig.get_paths()["purelib"])
    for p in (purelib / "nvidia" / "cu13" / "bin" / "cuobjdump", Path("/usr/local/cuda/bin/cuobjdump")):
        if p.is_file():
            return str(p)
    return None


def dump_sass(library: Path, arch: str, tool: str | None = None) -> str | None:
    """One arch's SASS of ``library``, or None (no cuobjdump, or it failed: e.g. no such arch).
    ``tool`` is cuobjdump's path (default: found by :func:`find_cuobjdump`), with nvdisasm beside it."""
    tool = tool or find_cuobjdump()
    if not tool:
        return None
    env = dict(os.environ)
    env["PATH"] = str(Path(tool).parent) + os.pathsep + env.get("PATH", "")  # nvdisasm beside it
    r = subprocess.run([tool, "--dump-sass", "-arch", arch, str(library)], capture_output=True,
                       text=True, env=env, timeout=300)
    return r.stdout if r.returncode == 0 else None


def sass_counts(library: Path, archs: list[str]) -> dict[str, dict[str, int]]:
    """Count instruction families in each arch's SASS ({} when cuobjdump is unavailable)."""
    tool = find_cuobjdump()
    if not tool:
        return {}
    counts: dict[str, dict[str, int]] = {}
    for arch in archs:
        sass = dump_sass(library, arch, tool)
        if sass is None:
            counts[arch] = {"error": 1}
            continue
        fam = {f: 0 for f in SASS_FAMILIES}
        for ins in re.findall(r"\b([A-Z][A-Z0-9]+)(?:\.[A-Za-z0-9_.]+)?\s", sass):
            if ins in fam:
                fam[ins] += 1
        counts[arch] = fam
    return counts


def flags_for(archs: list[str]) -> list[str]:
    """The gate's nvcc flags for ``archs``: BASE_FLAGS, one gencode each, and KDTREE_ARCHS."""
    return BASE_FLAGS + [gencode(a) for a in archs] + [f'-DKDTREE_ARCHS="{",".join(archs)}"']


def nvcc_command(root: Path, out: Path, archs: list[str], extra: list[str] = (), nvcc: str = "nvcc") -> list[str]:
    """The gate's nvcc command line: ``root``'s csrc/ into the library ``out``, with ``extra``
    flags after the gate's (tools/build_variant.py builds its A/B variants with it)."""
    return [nvcc, *flags_for(archs), *extra, "-I", str(Path(root) / "csrc"), "-o", str(out),
            *map(str, sources(Path(root)))]


def build(archs: list[str] | None = None, out_dir: Path | None = None, force: bool = False,
          root: Path | None = None) -> BuildResult:
    root = root or evidence.repo_root()
    archs = parse_archs(archs)
    nvcc = find_nvcc()
    nvcc_v = nvcc_version(nvcc)
    out_dir = Path(out_dir) if out_dir else default_out_dir(root)  # where provenance(root=root) looks
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIB_NAME
    flags = flags_for(archs)
    stamp_file = out_dir / (LIB_NAME + STAMP_SUFFIX)
    src_hash = csrc_hash(root)
    stamp = _stamp(src_hash, flags, nvcc_v)
    if not force and lib.is_file() and stamp_file.is_file():
        try:
            old = json.loads(stamp_file.read_text())
        except ValueError:
            old = {}
        if old.get("stamp") == stamp:
            new = dict(old)
            if not old.get("sass"):  # counted where cuobjdump was missing: count now if it is here, and keep it
                new["sass"] = sass_counts(lib, archs) or {}
            if "csrc_sha256" not in old:  # a stamp from before provenance: the stamp matched, so did csrc/
                new.update(csrc_sha256=src_hash, library_sha256=file_sha256(lib))
            if new != old:
                stamp_file.write_text(json.dumps(new, indent=1))
            old, sass = new, new.get("sass") or {}
            return BuildResult(lib, False, archs, flags, nvcc_v, old.get("kernels", {}), sass, old.get("log", ""))
    tmp = out_dir / (LIB_NAME + ".tmp")
    cmd = nvcc_command(root, tmp, archs, nvcc=nvcc)
    r = subprocess.run(cmd, capture_output=True, text=True)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed (exit {r.returncode}):\n{log.strip()}\ncommand: {' '.join(cmd)}")
    os.replace(tmp, lib)
    kernels = parse_ptxas(log)
    sass = sass_counts(lib, archs)
    # csrc_sha256 and library_sha256: what kernel.library.provenance checks a gate's library by
    stamp_file.write_text(json.dumps({"stamp": stamp, "csrc_sha256": src_hash,
                                      "library_sha256": file_sha256(lib), "kernels": kernels, "sass": sass,
                                      "log": log}, indent=1))
    return BuildResult(lib, True, archs, flags, nvcc_v, kernels, sass, log)


def spills(result: BuildResult) -> list[str]:
    bad = []
    for arch, ks in result.kernels.items():
        for k, v in ks.items():
            if v.get("spill_stores", 0) or v.get("spill_loads", 0):
                bad.append(f"{k} on {arch}: {v.get('spill_stores')} B spill stores, {v.get('spill_loads')} B spill loads")
    return bad


def serialized(result: BuildResult) -> list[str]:
    """Kernels whose wgmma pipeline ptxas serialized (its C7514, C7520, ... notes)."""
    return [f"{k} on {arch}" for arch, ks in result.kernels.items() for k, v in ks.items() if v.get("wgmma_serialized")]


#: what the kernel/tile choice reads of an sm_120 GPU (RTX PRO 6000 Blackwell; docs/kernel-notes.md
#: "sm_120 facts"): CC 12.0, 188 SMs, 1536 threads, 99 KB per block, 100 KB per SM
SM120_PROPS = (12, 0, 188, 1536, 99 * 1024, 100 * 1024)
#: tile -> the kernel function that runs it (as parse_ptxas names it)
TILE_KERNELS = {1: "verify_attn_kernel_sm90", 2: "verify_attn_kernel_mma_qreg"}


def sm120_fit(result: BuildResult) -> tuple[dict, list[str]]:
    """Does every configuration an sm_120 GPU gets fit sm_120's limits? Asks the built
    library's own choice (kdtree_choose_config: no GPU needed) for an sm_120 device, and
    for the sm_120 emulation on an H200, then checks the chosen tile against the limits
    and against ptxas's report of that kernel in the sm_120 code."""
    arch = next((a for a in ("sm_120a", "sm_120") if a in result.archs), None)
    if arch is None:
        return {}, []
    from kdtree_engine.kernel import library as L

    problems: list[str] = []
    try:
        lib = L.Library(result.library)
    except Exception as e:  # noqa: BLE001 - reported as the gate's reason
        return {}, [f"cannot load {result.library.name} to ask its sm_120 configuration: {e}"]
    flags = L.CFG_HAS_SM90A if "sm_90a" in result.archs else 0
    rc, cfg = lib.choose_config(L.KdtreeDeviceProps(*SM120_PROPS), L.TARGET_NATIVE, flags)
    if rc != L.OK:
        return {}, [f"no sm_120 configuration: {cfg.note.decode()}"]
    c = cfg.as_dict()
    rc_e, emu = lib.choose_config(L.KdtreeDeviceProps(9, 0, 132, 2048, 227 * 1024, 228 * 1024), L.TARGET_SM120, flags)
    if rc_e != L.OK or (emu.kernel, emu.tile, emu.ctas_per_sm) != (cfg.kernel, cfg.tile, cfg.ctas_per_sm):
        problems.append(f"the sm_120 emulation on an H200 chooses otherwise ({emu.as_dict()}) than sm_120 ({c})")
    limit = SM120_PROPS[4]
    if c["smem_bytes"] > limit:
        problems.append(f"sm_120 tile {c['name']} takes {c['smem_bytes']} B of shared memory; sm_120 allows {limit}")
    if c["ctas_per_sm"] < 1:
        problems.append(f"sm_120 tile {c['name']} fits no CTA per SM")
    kname = TILE_KERNELS.get(c["tile"])
    found = instances(result.kernels.get(arch, {}), kname or "?")  # the 3-D grid's and the batch schedule's
    if not found:
        problems.append(f"ptxas reported no {kname} for sm_120 (the kernel of tile {c['name']})")
    for inst, k in found.items():
        regs = k.get("registers") or 0
        if regs * c["threads"] * c["ctas_per_sm"] > 64 * 1024:
            problems.append(f"{inst}: {regs} registers x {c['threads']} threads x {c['ctas_per_sm']} CTAs exceed "
                            "sm_120's 64K registers per SM")
        if k.get("spill_stores") or k.get("spill_loads"):
            problems.append(f"{inst} spills on sm_120")
    hg = result.sass.get(arch, {}).get("HGMMA", 0)
    if hg:
        problems.append(f"sm_120 code holds {hg} HGMMA (wgmma): an instruction sm_120 lacks")
    fit = {"tile": c["name"], "kernel": kname, "smem_bytes": c["smem_bytes"], "smem_limit": limit,
           "threads": c["threads"], "ctas_per_sm": c["ctas_per_sm"],
           "registers": max((k.get("registers") or 0 for k in found.values()), default=None)}
    return fit, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kdtree build", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="target arch (repeatable or comma list); default sm_90a,sm_120a")
    ap.add_argument("--force", action="store_true", help="rebuild even when sources and flags are unchanged")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default build/lib)")
    ap.add_argument("--evidence-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        res = build(args.arch, args.out, args.force)
    except BuildError as e:
        print(f"build: FAILED: {e}", file=sys.stderr)
        rec = evidence.make_record("build", False, {}, "build failed", reason=str(e).splitlines()[0], device=None)
        evidence.write_record(rec, args.evidence_dir)
        return 1
    bad = spills(res)
    serial = serialized(res)
    missing = [a for a in res.archs if a not in res.kernels and res.rebuilt]
    mma = {a: (c.get("HMMA", 0) + c.get("HGMMA", 0)) for a, c in res.sass.items()}
    fit, fit_problems = sm120_fit(res)
    passed = not bad and not serial and not missing and not fit_problems
    reason = None
    if fit_problems:
        reason = "sm_120 limits: " + "; ".join(fit_problems)
    elif bad:
        reason = "register spills: " + "; ".join(bad)
    elif serial:
        reason = ("wgmma serialized by ptxas (C7514: an accumulator touched while its MMA is in flight; C7520: a "
                  "pipeline across a divergent branch): " + "; ".join(serial))
    elif missing:
        reason = f"ptxas reported no kernels for {missing}"
    regs = {a: {k: v.get("registers") for k, v in ks.items()} for a, ks in res.kernels.items()}
    headline = f"{','.join(res.archs)} built with nvcc {res.nvcc}; " + ", ".join(
        f"{a}: {max((r or 0) for r in regs.get(a, {}).values()) if regs.get(a) else '?'} regs max, 0 spills"
        for a in res.archs
    )
    if mma:
        headline += "; SASS MMA " + ", ".join(f"{a}={n}" for a, n in mma.items())
    else:
        headline += "; SASS not counted (no cuobjdump)"
    if fit and not fit_problems:
        headline += (f"; sm_120 tile {fit['tile']} fits sm_120 ({fit['smem_bytes'] / 1024:.1f} of "
                     f"{fit['smem_limit'] // 1024} KB, {fit['ctas_per_sm']} CTA/SM, {fit['registers']} regs x "
                     f"{fit['threads']} threads)")
    metrics = {
        "archs": res.archs,
        "nvcc": res.nvcc,
        "flags": res.flags,
        "library": str(res.library),
        "library_bytes": res.library.stat().st_size,
        "rebuilt": res.rebuilt,
        "kernels": res.kernels,
        "sass": res.sass,
        "sm120_fit": fit,
    }
    rec = evidence.make_record("build", passed, metrics, headline if passed else "build failed",
                               reason=reason, device=None)
    path = evidence.write_record(rec, args.evidence_dir)
    state = "rebuilt" if res.rebuilt else "up to date"
    print(f"build: {res.library} ({state})")
    for a, ks in res.kernels.items():
        for k, v in ks.items():
            print(f"  {a:7s} {k:24s} {v.get('registers', '?'):>4} regs  spills {v.get('spill_stores', 0)}/{v.get('spill_loads', 0)} B")
    for a, c in res.sass.items():
        print(f"  {a:7s} SASS: " + " ".join(f"{f}={n}" for f, n in c.items() if n))
    print(f"build: {'PASS' if passed else 'FAIL: ' + str(reason)}  (evidence {path})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
