"""The wheel: built once per session with ``pip wheel .`` (nvcc compiles the kernel library
into it), then checked as a user gets it: the library inside, runtime dependencies only
torch, and, installed into a folder outside the repository, ``library.load()`` resolving to
the packaged library and SGLang's ``load_plugins`` registering the hook from a working
directory outside the repository (no nvcc, no checkout, no KDTREE_LIB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from conftest import PROJECT

pytestmark = pytest.mark.nvcc

LIB_IN_WHEEL = "kdtree_engine/_lib/libkdtree_verify.so"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(PROJECT)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("kdtree_engine-*.whl")
    return whl


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed (--no-deps) into a --target folder; the test venv's torch and
    SGLang serve as the environment beside it."""
    site = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return site


def test_the_wheel_ships_the_library_for_both_archs_and_no_test_code(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        lib = z.read(LIB_IN_WHEEL)
    assert lib[:4] == b"\x7fELF" and len(lib) > 100_000
    for arch in (b"sm_90a", b"sm_120"):
        assert arch in lib, f"{arch.decode()} missing from the library's build info"
    assert not wheel.name.endswith("-none-any.whl"), "a wheel with a compiled library is platform-specific"
    assert not [n for n in names if n.startswith(("kdtree_engine/sglang/_standins", "kdtree_engine/smoke/fake_server"))]


def test_the_runtime_needs_only_torch(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
        eps = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    requires = meta.get_all("Requires-Dist") or []
    unconditional = [r for r in requires if "extra ==" not in r]
    assert [r.split(">")[0].split("=")[0].strip() for r in unconditional] == ["torch"], unconditional
    pipeline = [r for r in requires if 'extra == "pipeline"' in r]
    assert {r.split(">")[0].strip().lower() for r in pipeline} == {"jinja2", "gitpython", "nox", "invoke", "httpx"}
    assert "kdtree_verify = kdtree_engine.sglang.plugin:load" in eps


_OUTSIDE = r"""
import json, sys
import kdtree_engine
from kdtree_engine.kernel import library
from kdtree_pipeline.testing import standins
standins.install_torchvision_standin()  # CPU torch cannot load the CUDA torchvision wheels
import sglang.srt.plugins as sp
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from kdtree_engine.sglang import plugin
testing_seen = [m for m in sys.modules if m.startswith("kdtree_pipeline.testing")]
sp.load_plugins()
lib = library.load()
print(json.dumps({
    "package": kdtree_engine.__file__,
    "library": str(lib.path),
    "archs": lib.archs,
    "hooked": hasattr(TritonAttnBackend.__dict__["forward_extend"], "__wrapped__"),
    "hooks": list(HookRegistry._hooks),
    "status": plugin.status(),
}))
"""


def test_installed_wheel_loads_its_library_and_hooks_from_outside_the_repository(installed, tmp_path):
    elsewhere = tmp_path / "somewhere-else"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KDTREE_LIB", "KDTREE_ROOT", "SGLANG_PLUGINS",
                                                            "KDTREE_BUILD_DIR", "PYTHONPATH")}
    env.update(PYTHONPATH=str(installed), KDTREE_VERIFY="on", PATH="/usr/bin:/bin")  # no nvcc on PATH
    r = subprocess.run([sys.executable, "-c", _OUTSIDE], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    packaged = installed / "kdtree_engine" / "_lib" / "libkdtree_verify.so"
    assert Path(got["package"]).is_relative_to(installed), got["package"]
    assert got["library"] == str(packaged) and "sm_90a" in got["archs"] and "sm_120" in got["archs"]
    assert got["hooked"] and "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend" in got["hooks"]
    assert got["status"]["enabled"] is True and got["status"]["library"] == str(packaged)


def test_kdtree_lib_overrides_the_packaged_library(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KDTREE_ROOT", "PYTHONPATH")}
    env.update(PYTHONPATH=str(installed), KDTREE_LIB=str(tmp_path / "other.so"))
    code = ("from kdtree_engine.kernel import library\n"
            "print(library.default_library_path())\n"
            "try:\n    library.load()\nexcept library.KernelLibraryError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    assert first == str(tmp_path / "other.so") and "other.so does not exist" in second
