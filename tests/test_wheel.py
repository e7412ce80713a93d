"""The wheel, checked as a user gets it.

``pip wheel --no-deps .`` runs once per session on the checkout and, at the same time (two
nvcc builds share the two cores), on a copy of the checkout's files at another path and depth,
made with other file modes and times, and built under another umask. The copy always compiles
its library afresh, so the two wheels' bytes agree only if neither the library nor the zip
depends on where a tree lies, how or when its files were checked out, or when it was built.

Then, as a user gets it: the tag (any CPython 3, the glibc the library needs, as auditwheel
reads it), the files (the product and its metadata, nothing of the proof), the runtime
dependencies (torch only), an install into a Python 3.12 venv that loads the library from
outside any checkout with nothing but ctypes, and an install beside SGLang whose
``load_plugins`` registers the hook from the wheel's own entry point.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.utils import parse_wheel_filename

from conftest import PROJECT

pytestmark = pytest.mark.nvcc

LIB_IN_WHEEL = "kdtree_engine/_lib/libkdtree_verify.so"
DIST_INFO = "kdtree_engine-0.1.0.dist-info"
#: what the runs below must not inherit: a library or build folder named by the caller
KDTREE_VARS = ("KDTREE_LIB", "KDTREE_ROOT", "KDTREE_BUILD_DIR", "KDTREE_ARCHS", "SGLANG_PLUGINS", "PYTHONPATH")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KDTREE_VARS + ("SOURCE_DATE_EPOCH",)}
    env.update(extra)
    return env


def _tree_files(root: Path) -> list[str]:
    """The files a checkout's build reads: tracked ones and untracked ones git does not ignore."""
    r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"the wheel test copies the checkout's files with git: {r.stderr}"
    return sorted(f for f in r.stdout.split("\0") if f and (root / f).is_file())


#: the copy's files' time (2001-09-09): not the checkout's, whose files git wrote at checkout
COPY_MTIME = 1_000_000_000


def _copy_tree(root: Path, dest: Path) -> None:
    """``root``'s files into ``dest``, group-writable (as a checkout made under umask 002 has
    them) and with another modification time."""
    for f in _tree_files(root):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f, dest / f)
        (dest / f).chmod(0o775 if os.access(root / f, os.X_OK) else 0o664)
        os.utime(dest / f, (COPY_MTIME, COPY_MTIME))


def _pip_wheel(src: Path, out: Path, umask: int) -> subprocess.Popen:
    def set_umask() -> None:
        os.umask(umask)

    # SOURCE_DATE_EPOCH unset: the build's own choice must make the bytes the tree's
    return subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
                            cwd=out, env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=set_umask)


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> dict[str, Path]:
    """{"checkout": its wheel, "copy": the copy's wheel, "copy_root": where the copy lay}."""
    base = tmp_path_factory.mktemp("wheels")
    copy_root = base / "elsewhere" / "at" / "another" / "depth" / "kdtree-engine"
    _copy_tree(PROJECT, copy_root)
    outs = {"checkout": base / "from-checkout", "copy": base / "from-copy"}
    for o in outs.values():
        o.mkdir()
    procs = {"copy": _pip_wheel(copy_root, outs["copy"], 0o002), "checkout": _pip_wheel(PROJECT, outs["checkout"], 0o022)}
    got: dict[str, Path] = {"copy_root": copy_root}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=1500)
        assert p.returncode == 0, f"pip wheel of the {name} failed:\n{log[-4000:]}"
        wheels = list(outs[name].glob("kdtree_engine-*.whl"))
        assert len(wheels) == 1, f"pip wheel of the {name} left {wheels}"
        got[name] = wheels[0]
    return got


@pytest.fixture(scope="session")
def wheel(builds) -> Path:
    return builds["checkout"]


def _python312() -> str | None:
    """A Python 3.12 that runs: python3.12 on PATH, else one of pyenv's (its shim on PATH fails
    unless 3.12 is among pyenv's selected versions)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for cand in [shutil.which("python3.12"), *sorted(glob.glob(str(pyenv / "versions" / "3.12*" / "bin" / "python3.12")))]:
        if not cand:
            continue
        r = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True,
                           text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip() == "True":
            return cand
    return None


@pytest.fixture(scope="session")
def venv312(wheel, tmp_path_factory) -> Path:
    """A Python 3.12 venv with the wheel installed --no-deps (so no torch), and auditwheel."""
    py = _python312()
    if py is None:
        why = ("no Python 3.12 here (neither python3.12 on PATH nor one in pyenv's versions): the wheel's "
               "install on another Python than the one that built it is not checked")
        if os.environ.get("CI"):
            pytest.fail(why + "; CI's machine has one (pyenv), so its absence is a broken image")
        pytest.skip(why)
    venv = tmp_path_factory.mktemp("venv312") / "venv"
    r = subprocess.run([py, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    r = subprocess.run([*pip, "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300, env=_clean_env())
    assert r.returncode == 0, f"the wheel does not install into Python 3.12:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    r = subprocess.run([*pip, "auditwheel"], capture_output=True, text=True, timeout=600, env=_clean_env())
    assert r.returncode == 0, f"cannot install auditwheel into the 3.12 venv:\n{r.stderr[-3000:]}"
    return venv


def test_two_builds_of_one_tree_are_the_same_bytes_wherever_the_tree_lies(builds):
    a, b = builds["checkout"], builds["copy"]
    sha = {n: hashlib.sha256(w.read_bytes()).hexdigest() for n, w in (("checkout", a), ("copy", b))}
    assert a.name == b.name and sha["checkout"] == sha["copy"], (
        f"{PROJECT}: {a.name} {sha['checkout']}; {builds['copy_root']}: {b.name} {sha['copy']}")
    with zipfile.ZipFile(a) as z:
        lib = z.read(LIB_IN_WHEEL)
    for root in (PROJECT, builds["copy_root"]):
        assert str(root).encode() not in lib, f"the library holds its build tree's path {root}"
    assert b"/proc/self/cwd/csrc/kdtree_verify.cu" in lib, "the library lost its device line info's source names"


def test_the_wheel_is_tagged_for_any_python_3_by_the_glibc_its_library_needs(wheel, venv312):
    name, _version, _build, tags = parse_wheel_filename(wheel.name)
    (tag,) = tags
    assert (tag.interpreter, tag.abi) == ("py3", "none"), f"the library has no Python ABI, got {wheel.name}"
    with zipfile.ZipFile(wheel) as z:
        info = Parser().parsestr(z.read(f"{DIST_INFO}/WHEEL").decode())
    assert info.get_all("Tag") == [str(tag)] and info["Root-Is-Purelib"] == "false"
    # auditwheel reads the library's symbol versions and libraries itself: the tag it finds
    # consistent is the newest glibc (and libstdc++) the library needs
    r = subprocess.run([str(venv312 / "bin" / "auditwheel"), "show", str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(r.stdout.split())
    assert f'consistent with the following platform tag: "{tag.platform}"' in said, said


def test_the_wheel_holds_only_the_product(wheel):
    """The files of src/kdtree_engine, the library, and the dist-info: no kdtree_pipeline, no
    tests, no golden vectors, no console script."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(z.namelist())
        lib = z.read(LIB_IN_WHEEL)
        eps = z.read(f"{DIST_INFO}/entry_points.txt").decode()
    package = sorted("src/" + n for n in names if n.startswith("kdtree_engine/") and n != LIB_IN_WHEEL)
    sources = [f for f in _tree_files(PROJECT) if f.startswith("src/kdtree_engine/") and f.endswith(".py")]
    assert package == sources, f"the wheel's package differs from src/kdtree_engine: {set(package) ^ set(sources)}"
    assert [n for n in names if not n.startswith("kdtree_engine/")] == sorted(
        f"{DIST_INFO}/{f}" for f in ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt", "RECORD"))
    assert lib[:4] == b"\x7fELF" and len(lib) > 100_000
    for arch in (b"sm_90a", b"sm_120"):
        assert arch in lib, f"{arch.decode()} missing from the library's build info"
    # one entry point: SGLang's plugin; a command would need the checkout the pipeline runs from
    assert [line for line in eps.splitlines() if line.strip()] == [
        "[sglang.srt.plugins]", "kdtree_verify = kdtree_engine.sglang.plugin:load"], eps


def test_the_runtime_needs_only_torch(wheel):
    with zipfile.ZipFile(wheel) as z:
        meta = Parser().parsestr(z.read(f"{DIST_INFO}/METADATA").decode())
    requires = meta.get_all("Requires-Dist") or []
    unconditional = [r for r in requires if "extra ==" not in r]
    assert [r.split(">")[0].split("=")[0].strip() for r in unconditional] == ["torch"], unconditional
    pipeline = [r for r in requires if 'extra == "pipeline"' in r]
    assert {r.split(">")[0].strip().lower() for r in pipeline} == {"jinja2", "gitpython", "nox", "invoke", "httpx"}
    assert meta["Requires-Python"] == ">=3.10"


_LOAD = r"""
import importlib.metadata as md, importlib.util, json, sys
import kdtree_engine
from kdtree_engine.kernel import library
lib = library.load()
eps = md.entry_points(group="sglang.srt.plugins")
print(json.dumps({
    "python": list(sys.version_info[:2]),
    "package": kdtree_engine.__file__,
    "library": str(lib.path),
    "archs": lib.archs,
    "torch": importlib.util.find_spec("torch") is not None,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numpy", "kdtree_pipeline")),
    "plugins": {ep.name: ep.value for ep in eps},
}))
"""


def test_the_wheel_installs_on_python_3_12_and_loads_its_library_outside_any_checkout(venv312, tmp_path):
    site = Path(glob.glob(str(venv312 / "lib" / "python3.12" / "site-packages"))[0])
    r = subprocess.run([str(venv312 / "bin" / "python"), "-c", _LOAD], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=_clean_env(PATH="/usr/bin:/bin"))  # no nvcc, no checkout, no KDTREE_LIB
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    packaged = site / LIB_IN_WHEEL
    assert got["python"] == [3, 12] and Path(got["package"]).is_relative_to(site), got
    assert got["library"] == str(packaged) and "sm_90a" in got["archs"] and "sm_120" in got["archs"], got
    assert got["torch"] is False and got["modules"] == [], "loading the library needs only ctypes"
    assert got["plugins"] == {"kdtree_verify": "kdtree_engine.sglang.plugin:load"}
    assert not (venv312 / "bin" / "kdtree").exists(), "the wheel installed a console script"


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed (--no-deps) into a --target folder; the test venv's torch and
    SGLang serve as the environment beside it."""
    site = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return site


_OUTSIDE = r"""
import importlib.metadata as md, json, sys
import kdtree_engine
from kdtree_engine.kernel import library
from kdtree_pipeline.testing import standins
standins.install_torchvision_standin()  # CPU torch cannot load the CUDA torchvision wheels
import sglang.srt.plugins as sp
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from kdtree_engine.sglang import plugin
sp.load_plugins()
lib = library.load()
(ep,) = [ep for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "kdtree_verify"]
print(json.dumps({
    "package": kdtree_engine.__file__,
    "library": str(lib.path),
    "archs": lib.archs,
    "entry_point_from": str(ep.dist.locate_file("")),
    "hooked": hasattr(TritonAttnBackend.__dict__["forward_extend"], "__wrapped__"),
    "hooks": list(HookRegistry._hooks),
    "status": plugin.status(),
}))
"""


def test_installed_wheel_loads_its_library_and_hooks_from_outside_the_repository(installed, tmp_path):
    elsewhere = tmp_path / "somewhere-else"
    elsewhere.mkdir()
    # PYTHONPATH puts the wheel first: its package and its dist-info's entry point win over
    # an editable install of the checkout in the test venv
    env = _clean_env(PYTHONPATH=str(installed), KDTREE_VERIFY="on", PATH="/usr/bin:/bin")  # no nvcc on PATH
    r = subprocess.run([sys.executable, "-c", _OUTSIDE], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    packaged = installed / LIB_IN_WHEEL
    assert Path(got["package"]).is_relative_to(installed), got["package"]
    assert Path(got["entry_point_from"]) == installed, got["entry_point_from"]
    assert got["library"] == str(packaged) and "sm_90a" in got["archs"] and "sm_120" in got["archs"]
    assert got["hooked"] and "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend" in got["hooks"]
    assert got["status"]["enabled"] is True and got["status"]["library"] == str(packaged)


def test_kdtree_lib_overrides_the_packaged_library(installed, tmp_path):
    env = _clean_env(PYTHONPATH=str(installed), KDTREE_LIB=str(tmp_path / "other.so"))
    code = ("from kdtree_engine.kernel import library\n"
            "print(library.default_library_path())\n"
            "try:\n    library.load()\nexcept library.KernelLibraryError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    assert first == str(tmp_path / "other.so") and "other.so does not exist" in second
