"""Wheel builds compile the kernel library and ship it inside the package.

``pip wheel .`` / ``pip install .`` (not editable): ``build_py`` runs
:func:`kdtree_engine.kernel.build.build` (nvcc, sm_90a and sm_120a, static CUDA
runtime) and puts ``libkdtree_verify.so`` at ``kdtree_engine/_lib/`` in the wheel,
where :func:`kdtree_engine.kernel.library.load` looks first (after ``KDTREE_LIB``).
The wheel is then platform-specific and needs no nvcc where it is installed.
An editable install (``pip install -e .``) compiles nothing and keeps using the
checkout's ``build/lib``. ``KDTREE_ARCHS`` picks other archs (comma list).
Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BinaryDistribution(Distribution):
    """The wheel carries a compiled library: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


class BuildPyWithKernel(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable: the checkout's build/lib serves
        sys.path.insert(0, str(ROOT / "src"))
        try:
            from kdtree_engine.kernel import build as kbuild
        finally:
            sys.path.pop(0)
        out = Path(self.build_lib) / "kdtree_engine" / "_lib"
        cache = ROOT / "build" / "wheel-lib"  # keeps the nvcc stamp, so an unchanged tree is not rebuilt
        try:
            res = kbuild.build(None, cache, root=ROOT)
        except kbuild.BuildError as e:
            raise SystemExit(f"kdtree-engine wheel: cannot build the kernel library: {e}") from None
        problems = kbuild.spills(res) + kbuild.serialized(res)
        if problems:
            raise SystemExit(f"kdtree-engine wheel: the kernel build is not clean: {'; '.join(problems)}")
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(res.library, out / kbuild.LIB_NAME)
        print(f"kdtree-engine wheel: {res.library} ({'rebuilt' if res.rebuilt else 'up to date'}, "
              f"{','.join(res.archs)}) -> {out / kbuild.LIB_NAME}")


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithKernel})
