"""Wheel builds compile the kernel library and ship it inside the package.

``pip wheel .`` / ``pip install .`` (not editable): ``build_py`` runs
:func:`kdtree_engine.kernel.build.build` (nvcc, sm_90a and sm_120a, static CUDA
runtime) and puts ``libkdtree_verify.so`` at ``kdtree_engine/_lib/`` in the wheel,
where :func:`kdtree_engine.kernel.library.load` looks first (after ``KDTREE_LIB``).
The wheel needs no nvcc where it is installed. An editable install (``pip install -e .``)
compiles nothing and keeps using the checkout's ``build/lib``. ``KDTREE_ARCHS`` picks
other archs (comma list). Everything else is in pyproject.toml.

The tag is ``py3-none-manylinux_2_N_<arch>``. The library is loaded with ctypes and has no
Python ABI, so any CPython the project supports takes it; what it asks of the host is a glibc,
and ``N`` is the newest ``GLIBC_2.N`` symbol version the built library needs, read from its
ELF version-needs (:func:`manylinux_platform`), so a toolchain that links against newer
symbols changes the tag instead of making it a lie.

The wheel is reproducible, the same tree giving the same bytes: the library does not depend
on where the tree lies (kernel.build), the build folder is emptied first so nothing from an
older tree rides along, file modes are set rather than taken from the checkout's umask, the
zip's entries come in sorted order (setuptools) and their times come from
``SOURCE_DATE_EPOCH`` (set here when the caller has not set it), and pyproject.toml pins the
build backend, whose version the wheel's metadata names.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
LIB_DIR = Path("kdtree_engine") / "_lib"

#: The zip entries' time when the caller gives none: 1980-01-01 00:00 UTC, the earliest a zip
#: entry can hold. Any fixed value keeps the bytes the tree's; a checkout's file times would not
#: (git writes them at checkout).
os.environ.setdefault("SOURCE_DATE_EPOCH", "315532800")
#: The zip also records each file's mode. The dist-info files are written during the build, so
#: their modes follow the umask; the package's files are set in BuildPyWithKernel.
os.umask(0o022)

#: Libraries a manylinux wheel may leave to the host (PEP 600's: part of every glibc-based
#: distribution). The library links the CUDA runtime statically; any other dynamic dependency
#: (libcudart.so, say) would have to ship in the wheel, and the build refuses it.
HOST_LIBS = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
             "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libstdc++.so.6", "libgcc_s.so.1"}
#: ELF machine -> the architecture in a manylinux tag
ARCHS = {"EM_X86_64": "x86_64", "EM_AARCH64": "aarch64"}


class WheelBuildError(SystemExit):
    def __init__(self, why: str):
        super().__init__(f"kdtree-engine wheel: {why}")


def manylinux_platform(lib: Path) -> str:
    """``manylinux_2_N_<arch>`` for the shared library ``lib``: ``2.N`` is the newest GLIBC
    symbol version it needs (the lowest glibc that has every one of them), ``arch`` its ELF
    machine. Refuses a library that needs something a manylinux host need not have."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection

    glibc: list[tuple[int, int]] = []
    needed: set[str] = set()
    with open(lib, "rb") as f:
        elf = ELFFile(f)
        arch = ARCHS.get(elf["e_machine"])
        if arch is None:
            raise WheelBuildError(f"{lib}: expected an ELF for one of {', '.join(ARCHS)}, got {elf['e_machine']}")
        for section in elf.iter_sections():
            if isinstance(section, DynamicSection):
                needed |= {t.needed for t in section.iter_tags() if t.entry.d_tag == "DT_NEEDED"}
            if isinstance(section, GNUVerNeedSection):
                for _file, versions in section.iter_versions():
                    for v in versions:
                        m = re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", v.name)
                        if v.name.startswith("GLIBC_") and not m:
                            raise WheelBuildError(f"{lib}: needs {v.name}, which no manylinux host promises")
                        if m:
                            glibc.append((int(m.group(1)), int(m.group(2))))
    foreign = sorted(needed - HOST_LIBS)
    if foreign:
        raise WheelBuildError(f"{lib}: links {', '.join(foreign)} dynamically; a manylinux wheel may leave only "
                              f"{', '.join(sorted(HOST_LIBS))} to the host")
    major, minor = max(glibc, default=(2, 5))  # manylinux_2_5 (manylinux1) is PEP 600's oldest
    return f"manylinux_{major}_{minor}_{arch}"


def _kernel_build():
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from kdtree_engine.kernel import build as kbuild
    finally:
        sys.path.pop(0)
    return kbuild


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: not a pure wheel (setuptools then builds into a
    platform's folder and puts the files in platlib); its tag is ManylinuxWheel's."""

    def has_ext_modules(self) -> bool:
        return True


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        editable = getattr(self, "editable_mode", False)
        if not editable:
            # the wheel is made of whatever this folder holds: start it empty, so that a module
            # deleted from the tree (or a package of an older layout) does not ship
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
        if editable:
            return  # editable: the checkout's build/lib serves
        kbuild = _kernel_build()
        out = Path(self.build_lib) / LIB_DIR
        cache = ROOT / "build" / "wheel-lib"  # keeps the nvcc stamp, so an unchanged tree is not rebuilt
        try:
            res = kbuild.build(None, cache, root=ROOT)
        except kbuild.BuildError as e:
            raise WheelBuildError(f"cannot build the kernel library: {e}") from None
        problems = kbuild.spills(res) + kbuild.serialized(res)
        if problems:
            raise WheelBuildError(f"the kernel build is not clean: {'; '.join(problems)}")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(res.library, out / kbuild.LIB_NAME)
        # the zip records each file's mode: set it, rather than take the checkout's umask
        for p in Path(self.build_lib).rglob("*"):
            if p.is_file():
                p.chmod(0o755 if p.suffix == ".so" else 0o644)
        print(f"kdtree-engine wheel: {res.library} ({'rebuilt' if res.rebuilt else 'up to date'}, "
              f"{','.join(res.archs)}) -> {out / kbuild.LIB_NAME}")


class ManylinuxWheel(bdist_wheel):
    shipping = False  # set by run(); an editable install asks for a tag without running it

    def run(self) -> None:
        self.shipping = True
        super().run()

    def get_tag(self) -> tuple[str, str, str]:
        if not self.shipping:  # an editable wheel ships no library: the default tag fits this interpreter
            return super().get_tag()
        lib = Path(self.get_finalized_command("build_py").build_lib) / LIB_DIR / _kernel_build().LIB_NAME
        if not lib.is_file():
            raise WheelBuildError(f"no kernel library at {lib} to tag the wheel by")
        return "py3", "none", manylinux_platform(lib)


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithKernel, "bdist_wheel": ManylinuxWheel})
