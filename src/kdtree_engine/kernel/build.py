"""Compile ``csrc/`` with nvcc into one shared library, ``libkdtree_verify.so``.

One ``-gencode`` per target arch, a static CUDA runtime (so the library loads
through ctypes in any Python), ``-Xptxas -v`` for per-kernel registers and
spills, and a stamp (sources + flags + nvcc version) so that an unchanged tree
is not rebuilt. The stamp also names the csrc/ hash and the library's sha256, so
that whoever runs the library can tell which sources built it. :func:`spills` and
:func:`serialized` read ptxas's report: a spill (no kernel here declares one) or a
wgmma pipeline that ptxas serialized (its "wgmma.mma_async instructions are
serialized" notes: C7514, a non-wgmma instruction touches an accumulator while the
MMA is in flight; C7520, a wgmma pipeline across a branch ptxas takes for divergent)
makes a build unfit to ship, since the kernel then runs correct and much slower.
When ``cuobjdump`` is available (the ``build`` extra: ``nvidia-cuda-cuobjdump``,
``nvidia-cuda-nvdisasm``) the stamp also counts each arch's tensor-core and
async-copy instructions. ``setup.py`` builds the wheel's library with :func:`build`.

The library's bytes depend on the sources, the flags and the toolkit, not on where the
tree lies or which process built it (:func:`nvcc_command` says how), so two checkouts of one
tree build the same file and the wheel that ships it is reproducible.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# one spelling of the file names and of where the library goes
from kdtree_engine.kernel.library import (
    LIB_NAME,
    STAMP_SUFFIX,
    KernelLibraryError,
    default_out_dir,
    source_root,
)

#: sm_90a = Hopper with its arch-specific instructions (wgmma): the H100/H200 kernel;
#: sm_120a = RTX PRO 6000 Blackwell and RTX 5090, compute capability 12.0 (the mma.sync path; "a"
#: for setmaxnreg, which gives the tile's math warps the producer warpgroup's registers).
#: ``--arch sm_90`` builds the portable path only; generic sm_90 or sm_120 code has no setmaxnreg,
#: so that tile then spills (correct, slower; the build gate reports it).
DEFAULT_ARCHS = ("sm_90a", "sm_120a")
BASE_FLAGS = ["-O3", "-lineinfo", "-std=c++17", "-Xptxas=-v,--warn-on-spills", "-shared",
              "-Xcompiler", "-fPIC", "-cudart", "static"]
#: How the sources are named to nvcc. Three things in the library would otherwise depend on
#: where the tree lies or when it was checked out (nvcc 13.0, each tried):
#: ``-lineinfo`` writes each source's absolute path into the device line table and the
#: fatbinary (a relative name is made absolute by cicc, and ``-Xcompiler -ffile-prefix-map``
#: reaches only the host compiler; nvcc has no prefix map of its own); ptxas writes each
#: source's modification time into that line table; and cudafe++ names anonymous namespaces
#: after a hash of the source's real path (``--orig_src_path_name``, which nvcc resolves
#: through symlinks and /proc). So :func:`run_nvcc` compiles a copy of csrc/ whose files carry
#: the time 0 (DWARF's "unknown"), from the copy's parent as working directory, naming every
#: source as ``/proc/self/cwd/csrc/...``: an absolute name is kept as given, the string is the
#: same for every tree, and a tool (ncu, cuda-gdb) run from a checkout's root still finds the
#: files. The namespace hash is seeded with the same string; the namespaces stay apart per
#: source, since their names also hold the file's name and a hash of its own.
SOURCE_PREFIX = Path("/proc/self/cwd")
#: Part of the build's identity beside the flags: a library built by an older recipe (absolute
#: source paths, file times, nvcc's temporary file names) is rebuilt, not reused from its stamp.
RECIPE = "csrc copied with time 0, named /proc/self/cwd/csrc, path hash seeded with it, intermediates kept"
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
    """The build's identity: csrc/'s hash (:func:`csrc_hash`), the flags, nvcc's version and
    the :data:`RECIPE`."""
    h = hashlib.sha256(src_hash.encode())
    h.update(json.dumps([flags, nvcc_v, RECIPE]).encode())
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


def work_dir(out: Path) -> Path:
    """The folder :func:`run_nvcc` builds the library ``out`` in, removed afterwards: ``tree``,
    the copy of csrc/ that nvcc compiles, and ``keep``, nvcc's intermediate files. Without
    ``--keep`` nvcc writes those to /tmp as ``tmpxft_<pid>_...``, and that name reaches the
    library's symbol table (the host object's FILE symbol), so two builds would differ."""
    out = Path(out).absolute()
    return out.with_name(out.name + ".nvcc")


def nvcc_command(root: Path, out: Path, archs: list[str], extra: list[str] = (), nvcc: str = "nvcc") -> list[str]:
    """The gate's nvcc command line: ``root``'s csrc/ into the library ``out``, with ``extra``
    flags after the gate's (an A/B variant is this command with a -D switch added). It names
    the sources through :data:`SOURCE_PREFIX`, so it runs in a folder holding csrc/:
    :func:`run_nvcc` runs it on a copy of ``root``'s."""
    csrc = SOURCE_PREFIX / "csrc"
    return [nvcc, *flags_for(archs), *extra, "-I", str(csrc), "-Xcudafe", f"--orig_src_path_name={csrc}",
            "--keep", "--keep-dir", str(work_dir(out) / "keep"), "-o", str(Path(out).absolute()),
            *(str(csrc / p.name) for p in sources(Path(root)))]


def run_nvcc(cmd: list[str], root: Path) -> subprocess.CompletedProcess:
    """Run an :func:`nvcc_command` line on a copy of ``root``'s csrc/ (every file's time set
    to 0), in its :func:`work_dir`, which is removed afterwards."""
    keep = Path(cmd[cmd.index("--keep-dir") + 1])
    work = keep.parent
    shutil.rmtree(work, ignore_errors=True)
    tree = work / "tree"
    try:
        shutil.copytree(Path(root) / "csrc", tree / "csrc")
        for p in (tree / "csrc").rglob("*"):
            os.utime(p, (0, 0))
        keep.mkdir()
        return subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build(archs: list[str] | None = None, out_dir: Path | None = None, force: bool = False,
          root: Path | None = None) -> BuildResult:
    try:
        root = Path(root) if root is not None else source_root()
    except KernelLibraryError as e:
        raise BuildError(str(e)) from None
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
    r = run_nvcc(cmd, root)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed (exit {r.returncode}):\n{log.strip()}\ncommand (run on a copy of {root / 'csrc'}): "
                         f"{' '.join(cmd)}")
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
