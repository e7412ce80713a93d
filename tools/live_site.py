"""Make ``.live/live.tar.xz``: what a real SGLang server needs on the GPU host beyond its image.

    python3 tools/live_site.py            # ~50 MB, a few minutes (downloads, then xz -9)

The GPU host has python3.12 with torch 2.11.0+cu130, triton 3.6 and nvcc, and no network.
SGLang 0.5.17 is the newest release that pins torch 2.11.0, so the bundle carries it with
sglang-kernel 0.4.5 cut to the sm_90 library the triton attention backend needs (its FA3,
FlashMLA, infllm and sm_100 libraries, over 1 GB, are dropped), flashinfer (imported at
module load by many SGLang modules; the launch flags keep every flashinfer kernel from being
called, so nothing compiles), transformers 5.12.1 (SGLang's pin; the host's newer one defines
a model type SGLang registers again) with the tokenizers its import-time check accepts,
and every pure-Python requirement the host image lacks (``tools/gpu-host-packages.txt``).

Left out, each imported at server start only by a path the smoke gate never takes: xgrammar
(44 MB; ``--grammar-backend none``) and DeepGEMM (the DeepSeek-V3.2 sparse attention backend,
imported when CUDA graphs are captured). ``kdtree_pipeline/smoke/standins`` holds import-only
stand-ins for both, which the gate puts on the server's path.

On the GPU host: ``mkdir -p /tmp/live && tar -xJf .live/live.tar.xz -C /tmp/live`` and put
/tmp/live first on PYTHONPATH (the smoke gate's ``--site`` does this for the server).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
#: What the bundle is built around, exactly.
TOP = ("sglang==0.5.17", "sglang-kernel==0.4.5", "flashinfer-python==0.6.15.post1", "cuda-python==13.0.3",
       "transformers==5.12.1", "tokenizers==0.22.2",
       "jsonschema==4.26.0",  # imported by the HTTP server's chat endpoint; sglang does not require it
       "dill==0.4.0")  # imported at load by sampling/custom_logit_processor; only excluded packages require it
#: Requirements never bundled: the host's own (torch, triton), what TOP pins, the stand-ins' packages,
#: and optional kernel or media packages no path of the smoke gate imports.
EXCLUDED = set("""
flash-attn-4 helion humming-kernels nvidia-cutlass-dsl nvidia-mathdx quack-kernels tokenspeed-mla tilelang
torchao torchcodec sgl-deep-gemm sgl-deep-ep kernels smg-grpc-servicer modelscope datasets mistral-common outlines
llguidance openai-harmony py-spy av decord2 torch torchvision torchaudio triton transformers tokenizers
sglang-kernel sglang flashinfer-python flashinfer-cubin anthropic xgrammar cuda-python nvidia-cudnn-frontend
""".split())
#: sgl_kernel's libraries the triton backend never loads (FA3, FlashMLA, infllm, sm_100).
DROP = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops*.so",
        "sgl_kernel/sm100", "bin")
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(spec: str, dest: Path) -> list[Path]:
    """The one wheel of ``spec`` for CPython 3.12 on x86_64 Linux (no dependencies)."""
    before = set(dest.glob("*.whl"))
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(dest), spec],
                       capture_output=True, text=True)
    new = sorted(set(dest.glob("*.whl")) - before)
    if r.returncode or not new:
        have = [w for w in dest.glob("*.whl") if norm(w.name.split("-")[0]) == norm(Requirement(spec).name)]
        if have:
            return have
        raise SystemExit(f"live_site: cannot download {spec}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return new


def requirements(wheel: Path) -> list[str]:
    env = default_environment()
    env.update(python_version="3.12", python_full_version="3.12.3", sys_platform="linux",
               platform_machine="x86_64", implementation_name="cpython", extra="")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                out.append(str(req).split(";")[0].strip())
    return out


def resolve(dest: Path, host: set[str]) -> list[Path]:
    """TOP and the requirements they close over, less the host's packages and EXCLUDED."""
    wheels: list[Path] = []
    done: set[str] = set()
    queue = list(TOP)
    while queue:
        spec = queue.pop(0)
        name = norm(Requirement(spec).name)
        top = spec in TOP
        if name in done or (not top and (name in EXCLUDED or name in host)):
            continue
        done.add(name)
        got = download(spec, dest)
        wheels += got
        for w in got:
            queue += requirements(w)
    return wheels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE.parent / ".live" / "live.tar.xz")
    args = ap.parse_args(argv)
    lines = (HERE / "gpu-host-packages.txt").read_text().splitlines()
    host = {norm(line.split("#")[0].strip()) for line in lines if line.split("#")[0].strip()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "whl").mkdir()
        wheels = resolve(tmp / "whl", host)
        site = tmp / "site"
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        for pattern in DROP:
            for p in site.glob(pattern):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for p in list(site.rglob("__pycache__")):
            shutil.rmtree(p, ignore_errors=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        part = args.out.with_suffix(".part")
        names = sorted(p.name for p in site.iterdir())
        # the xz binary compresses on every core (Python's tarfile on one)
        with open(part, "wb") as f:
            tar = subprocess.Popen(["tar", "-C", str(site), "--sort=name", "-cf", "-", *names], stdout=subprocess.PIPE)
            xz = subprocess.run(["xz", "-T0", "-9"], stdin=tar.stdout, stdout=f)
            tar.stdout.close()
            if tar.wait() or xz.returncode:
                raise SystemExit(f"live_site: tar exited {tar.returncode}, xz {xz.returncode}")
        part.replace(args.out)
    print(f"live_site: {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB, {len(wheels)} wheels: "
          + ", ".join(sorted(w.name.split("-")[0] for w in wheels)) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
