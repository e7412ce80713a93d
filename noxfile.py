"""nox sessions: one per gate (docs/design.md section 3), plus ``tests`` and ``lint``.

Every gate session runs ``python -m kdtree_pipeline <gate> *posargs``, which
writes the gate's evidence record. Its arguments are checked first (a bad bench
suite or system is named before anything else). GPU gates are ``default=False``
and tagged ``gpu``; on a machine without a CUDA device they fail with one
sentence (never skip). All sessions also run with ``nox --no-venv`` on a host that cannot make
virtual environments (the offline GPU host): nothing is installed then, and the
interpreter running nox runs the gate.
"""

from __future__ import annotations

import os
import sys

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_venv = "yes"

#: pip takes this CPU build from the local wheel cache here; an unpinned torch
#: would pull a multi-GB CUDA build into every venv.
TORCH = os.environ.get("KDTREE_TORCH_PIN", "torch==2.13.0")
SGLANG = "sglang==0.5.23"
#: The ends of the SGLang range the plugin supports (kdtree_engine.sglang.fallback.SUPPORTED), and
#: the transformers / tokenizers each pins (their import-time checks refuse others).
DRIFT_RELEASES = {
    "0.5.17": ("transformers==5.12.1", "tokenizers==0.22.2"),
    "0.5.23": ("transformers==5.19.0", "tokenizers==0.23.2"),
}
#: What `sglang.srt.plugins.hook_registry` and
#: `sglang.kernels.ops.attention.extend_attention` need to import on a CPU
#: (sglang itself goes in with --no-deps). `triton_backend` needs torchvision
#: too, whose PyPI build does not load beside the CPU torch.
SGLANG_CPU_DEPS = (
    # sglang.srt.plugins.hook_registry, sglang.kernels.ops.attention.extend_attention
    "numpy", "orjson", "psutil", "pybase64", "requests", "triton", "packaging", "pillow",
    "starlette", "anyio", "msgspec", "pydantic", "pyzmq", "tqdm", "ipython", "aiohttp", "dill",
    # sglang.srt.layers.attention.triton_backend, its memory pools and the radix cache
    "sentencepiece==0.2.1", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.18.0", "loguru",
    "gguf", "openai==2.8.0", "distro", "partial-json-parser", "einops",
)
PYTEST_FLAGS = ("-ra", "--strict-markers", "--strict-config")
CUDA_PROBE = (
    "try:\n"
    "    import torch\n"
    "    ok = torch.cuda.is_available()\n"
    "except Exception as e:\n"
    "    print('torch import failed:', e)\n"
    "    ok = False\n"
    "print('cuda-available' if ok else 'no-cuda')\n"
)


def _has_venv(session: nox.Session) -> bool:
    return session.venv_backend != "none"


#: kdtree_pipeline is not installed: every session imports it from the checkout's src/.
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src")
PIPELINE_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)}


def _python(session: nox.Session) -> str:
    """The venv's python, or with --no-venv the interpreter running nox."""
    return "python" if _has_venv(session) else sys.executable


#: The project with what the tests and gates use (the pipeline's tools are an extra:
#: a server needs only torch).
PROJECT_EXTRAS = "dev,pipeline"


def _install_project(session: nox.Session, extras: str = PROJECT_EXTRAS) -> None:
    if _has_venv(session):
        session.install("-e", f".[{extras}]", TORCH)


ARGS_CHECK = (
    "import sys\n"
    "from kdtree_pipeline.__main__ import check_args\n"
    "print(check_args(sys.argv[1], sys.argv[2:]) or 'args-ok')\n"
)


def _check_args(session: nox.Session, gate: str, args: tuple[str, ...]) -> None:
    """Refuse bad gate arguments (e.g. an unknown bench suite) before any GPU check:
    the same pure check the module entry point runs first."""
    out = session.run(_python(session), "-c", ARGS_CHECK, gate, *args, silent=True, log=False,
                      env=PIPELINE_ENV) or ""
    lines = out.strip().splitlines()
    if not lines or lines[-1] != "args-ok":
        session.error(f"gate {gate}: {lines[-1] if lines else 'the argument check printed nothing'}")


def _require_cuda(session: nox.Session, gate: str) -> None:
    out = session.run(_python(session), "-c", CUDA_PROBE, silent=True, log=False) or ""
    if "cuda-available" not in out:
        session.error(
            f"gate {gate} needs a CUDA GPU and torch here sees none; "
            f"run `nox --no-venv -s {gate}` on a GPU host"
        )


def _gate(session: nox.Session, gate: str, *, gpu: bool, default_args: tuple[str, ...] = (),
          extras: str = PROJECT_EXTRAS) -> None:
    _install_project(session, extras)
    args = tuple(session.posargs or default_args)
    _check_args(session, gate, args)
    if gpu:
        _require_cuda(session, gate)
    session.run(_python(session), "-m", "kdtree_pipeline", gate, *args, env=PIPELINE_ENV)


# Gate venvs see the system site-packages, so an installed torch is reused.
GATE_VENV = ["--system-site-packages"]


@nox.session(venv_params=GATE_VENV)
def build(session: nox.Session) -> None:
    """Compile csrc/ with nvcc for every target arch and count its SASS (no GPU needed)."""
    _gate(session, "build", gpu=False, extras=PROJECT_EXTRAS + ",build")  # build: cuobjdump + nvdisasm


@nox.session(name="oracle-selftest", venv_params=GATE_VENV)
def oracle_selftest(session: nox.Session) -> None:
    """Check the fp32 reference against an independent formulation and golden vectors."""
    _gate(session, "oracle-selftest", gpu=False)


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu"])
def oracle(session: nox.Session) -> None:
    """Check the kernel against the fp32 reference over the shape matrix (GPU)."""
    _gate(session, "oracle", gpu=True)


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu"])
def bench(session: nox.Session) -> None:
    """Benchmark the kernel against its peers side by side: `-- --suite micro|long-context|...` (GPU)."""
    _gate(session, "bench", gpu=True, default_args=("--suite", "micro"))


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu"])
def integrate(session: nox.Session) -> None:
    """Run SGLang's TritonAttnBackend TARGET_VERIFY with the plugin on vs off (GPU)."""
    _gate(session, "integrate", gpu=True)


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu", "server"])
def smoke(session: nox.Session) -> None:
    """Check a live SGLang server through the plugin: `-- --url URL` or `-- --launch CMD`."""
    _gate(session, "smoke", gpu=False)  # the server holds the GPU; no server -> the gate fails


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu"])
def graph(session: nox.Session) -> None:
    """Capture and replay the verify step in a CUDA graph; replay must equal eager (GPU)."""
    _gate(session, "graph", gpu=True)


@nox.session(venv_params=GATE_VENV, default=False, tags=["gpu"])
def defrag(session: nox.Session) -> None:
    """Check KV compaction and measure fragmented vs compact cost (GPU)."""
    _gate(session, "defrag", gpu=True)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (GPU tests skip without a GPU); posargs go to pytest.
    tests/test_wheel.py builds the wheel (nvcc) and installs it outside the repository."""
    if _has_venv(session):
        session.install("-e", f".[{PROJECT_EXTRAS}]", TORCH)
        session.install("--no-deps", SGLANG)
        session.install(*SGLANG_CPU_DEPS, *DRIFT_RELEASES[SGLANG.split("==")[1]], TORCH)
        session.install("--no-deps", "-e", ".")  # the plugin's entry point must be discoverable
    session.run(_python(session), "-m", "pytest", *PYTEST_FLAGS, *(session.posargs or ("-q",)))
    if not session.posargs:  # the whole suite ran: check the plugin against both ends of its range too
        for release in DRIFT_RELEASES:
            session.notify(f"drift({release})")


#: The tests that read SGLang's own classes: what the plugin hooks, reads and calls.
DRIFT_TESTS = ("tests/test_sglang_drift.py", "tests/test_sglang_fallback.py", "tests/test_sglang_plugin.py")


@nox.session
@nox.parametrize("release", list(DRIFT_RELEASES), ids=list(DRIFT_RELEASES))
def drift(session: nox.Session, release: str) -> None:
    """Check the plugin against one SGLang release of its supported range (CPU, SGLang --no-deps)."""
    if _has_venv(session):
        session.install("-e", f".[{PROJECT_EXTRAS}]", TORCH)
        session.install("--no-deps", f"sglang=={release}")
        session.install(*SGLANG_CPU_DEPS, *DRIFT_RELEASES[release], TORCH)
        session.install("--no-deps", "-e", ".")
    out = session.run(_python(session), "-c", "import importlib.metadata as m; print(m.version('sglang'))",
                      silent=True) or ""
    if out.strip().splitlines()[-1:] != [release]:
        session.error(f"drift({release}): the SGLang here is {out.strip() or 'missing'}, not {release}")
    # 0.5.17 imports xgrammar at module load on the paths these tests import; the live server gets the
    # same import-only stand-in (kdtree_pipeline/smoke/standins), so the tests see what it sees
    standins = os.path.join(SRC, "kdtree_pipeline", "smoke", "standins")
    session.run(_python(session), "-m", "pytest", *PYTEST_FLAGS, "-q", *(session.posargs or DRIFT_TESTS),
                env={"PYTHONPATH": os.pathsep.join((SRC, standins))})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the project (config in pyproject.toml)."""
    if _has_venv(session):
        session.install("ruff")
    session.run(_python(session), "-m", "ruff", "check", *(session.posargs or (".",)))
