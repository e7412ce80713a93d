"""Build FlashMLA's sm_90 dense decode from FlashMLA's own source into a ctypes library, as it is or
as a timing-only variant, so that a probe can time FlashMLA's loop with and without its key loads.

    python3 tools/build_fm_src.py build/lib/fmsrc --flashmla <FlashMLA git dir> --cutlass <cutlass git dir>
    python3 tools/build_fm_src.py build/lib/fmnold --flashmla ... --cutlass ... --no-kv-loads

Why: the bench's FlashMLA is a compiled wheel. Our loop with no key copies at all (`nold2`,
docs/kernel-notes.md AF11) takes the cycles FlashMLA takes with its copies, so the copies cost our
loop 8-12% (AG2); whether they cost FlashMLA's loop as much could not be measured without a
FlashMLA build. This tool makes one: `--no-kv-loads` drops the key tiles' TMA copies from the main
kernel (the math waits on the same mbarriers, armed without a byte count; both key buffers are
zeroed once a CTA, so the math runs on finite numbers). Its output is wrong by design.

Sources come from git repositories (the `fetch` tool's mirrors), read with GitPython at a commit, not
from a work tree: FlashMLA at ``--rev`` (default HEAD) and CUTLASS at the commit FlashMLA's
csrc/cutlass submodule pins, so a build names exactly what it compiled (``build.json``). Compiled:
the bf16 instantiation of csrc/sm90/decode/dense, the combine and the schedule kernels of
csrc/smxx/decode, and tools/fm_src/fm_dense_capi.cu (the C ABI; FlashMLA's own host code is torch's).
nvcc flags are FlashMLA's setup.py's, for sm_90a only. Exit 1 when nvcc fails, 2 on bad input,
3 when FlashMLA's source no longer has what a variant edits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kdtree_engine.kernel import build as B  # noqa: E402

LIB_NAME = "libfm_dense.so"
CAPI = Path(__file__).resolve().parent / "fm_src" / "fm_dense_capi.cu"
KERNEL_FILE = "csrc/sm90/decode/dense/splitkv_mla.cuh"
SOURCES = (
    "csrc/sm90/decode/dense/instantiations/bf16.cu",
    "csrc/smxx/decode/combine/combine.cu",
    "csrc/smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
)
#: FlashMLA's setup.py flags (nvcc), for the sm_90a target only
FLAGS = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
         "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
         "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "--expt-relaxed-constexpr", "--expt-extended-lambda",
         "--use_fast_math", "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills", "-lineinfo",
         "-gencode", "arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", "-DFLASH_MLA_DISABLE_FP16"]

# --no-kv-loads: (what FlashMLA's splitkv_mla.cuh has, what replaces it, how many times it must occur)
ZERO_KV = """#ifdef FM_NO_KV_LOADS
    {   // timing-only build: no key copies; both key buffers zeroed once, so the math sees finite numbers
        uint4* k0 = reinterpret_cast<uint4*>(plan.smem_sK0.data());
        uint4* k1 = reinterpret_cast<uint4*>(plan.smem_sK1.data());
        constexpr int kVecs = int(sizeof(plan.smem_sK0) / sizeof(uint4));
        for (int i = threadIdx.x; i < kVecs; i += T::NUM_THREADS) {
            k0[i] = make_uint4(0u, 0u, 0u, 0u);
            k1[i] = make_uint4(0u, 0u, 0u, 0u);
        }
        cutlass::arch::fence_view_async_shared();
    }
#endif
"""
NO_KV_LOADS = (
    ("        cute::copy(tma_K.with(reinterpret_cast<typename TMABarrier::ValueType &>(barriers_K[START_HEAD_DIM_TILE_IDX]), "
     "0, cute::TMA::CacheHintSm90::EVICT_FIRST), cur_gKV, cur_sKV);\n",
     "#ifndef FM_NO_KV_LOADS\n"
     "        cute::copy(tma_K.with(reinterpret_cast<typename TMABarrier::ValueType &>(barriers_K[START_HEAD_DIM_TILE_IDX]), "
     "0, cute::TMA::CacheHintSm90::EVICT_FIRST), cur_gKV, cur_sKV);\n#endif\n", 1),
    ("        barrier->arrive_and_expect_tx(64*64*2);\n",
     "#ifdef FM_NO_KV_LOADS\n        barrier->arrive();\n#else\n        barrier->arrive_and_expect_tx(64*64*2);\n#endif\n", 2),
    ("                    barriers_K0[i].arrive_and_expect_tx(64*64*2);\n",
     "#ifdef FM_NO_KV_LOADS\n                    barriers_K0[i].arrive();\n#else\n"
     "                    barriers_K0[i].arrive_and_expect_tx(64*64*2);\n#endif\n", 1),
    ("        cutlass::arch::fence_view_async_shared();\n    }\n    __syncthreads();\n",
     "        cutlass::arch::fence_view_async_shared();\n    }\n" + ZERO_KV + "    __syncthreads();\n", 1),
)


class SourceChanged(Exception):
    """FlashMLA's source no longer holds a text a variant edits (exit 3)."""


def edit_no_kv_loads(text: str) -> str:
    """FlashMLA's splitkv_mla.cuh -> the same with the FM_NO_KV_LOADS switch in place. Each edit must
    match exactly as often as FlashMLA 9241ae3 has it, else SourceChanged names it."""
    for old, new, count in NO_KV_LOADS:
        found = text.count(old)
        if found != count:
            raise SourceChanged(f"{KERNEL_FILE}: expected {count} of {old.strip()[:70]!r}, found {found}")
        text = text.replace(old, new)
    return text


def _tree_to(tree, dest: Path, skip: tuple[str, ...] = ()) -> None:
    for item in tree.traverse():
        if item.type != "blob" or any(item.path.startswith(s) for s in skip):
            continue
        out = dest / item.path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(item.data_stream.read())


def open_repo(path: Path):
    """A GitPython Repo of ``path``, a work tree or a bare git directory (the `fetch` tool's mirrors are
    bare and lack a config file, so GIT_DIR is set for the git that GitPython runs)."""
    try:
        import git  # GitPython
    except ImportError:
        raise ValueError("this tool reads git with GitPython: pip install GitPython") from None
    repo = git.Repo(path)
    if not (path / ".git").exists():
        repo.git.update_environment(GIT_DIR=str(path.resolve()))
    return repo


def extract(flashmla: Path, rev: str, cutlass: Path, dest: Path) -> dict:
    """FlashMLA's csrc/ at ``rev`` and CUTLASS's include/ at FlashMLA's pinned submodule commit,
    written under ``dest``; returns both commits. A ValueError names what git cannot give."""
    try:
        fm = open_repo(flashmla).commit(rev)
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"--flashmla/--rev: {rev!r} is not a commit of {flashmla} ({e.__class__.__name__})") from None
    try:
        pin = fm.tree / "csrc/cutlass"
    except KeyError:
        raise ValueError(f"--flashmla: commit {fm.hexsha[:12]} has no csrc/cutlass submodule") from None
    try:
        cu = open_repo(cutlass).commit(pin.hexsha)
    except Exception as e:
        raise ValueError(f"--cutlass: {cutlass} lacks commit {pin.hexsha} that FlashMLA pins "
                         f"({e.__class__.__name__})") from None
    _tree_to(fm.tree / "csrc", dest / "FlashMLA", skip=("csrc/cutlass",))
    _tree_to(cu.tree / "include", dest / "cutlass")
    return {"flashmla": fm.hexsha, "cutlass": cu.hexsha}


def commands(root: Path, out: Path, nvcc: str, defines: list[str]) -> tuple[list[list[str]], list[str]]:
    """(compile commands, one per source -> .o; the link command)."""
    csrc = root / "FlashMLA" / "csrc"
    inc = [f"-I{p}" for p in (csrc, csrc / "kerutils" / "include", csrc / "sm90", root / "cutlass" / "include")]
    objs, cmds = [], []
    for i, src in enumerate([root / "FlashMLA" / s for s in SOURCES] + [CAPI]):
        obj = root / f"obj{i}.o"
        cmds.append([nvcc, *FLAGS, *defines, *inc, "-c", str(src), "-o", str(obj)])
        objs.append(str(obj))
    link = [nvcc, "-shared", "-gencode", "arch=compute_90a,code=sm_90a", *objs, "-o", str(out)]
    return cmds, link


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help=f"folder for {LIB_NAME} and build.json")
    ap.add_argument("--flashmla", type=Path, required=True, help="a git repository of FlashMLA")
    ap.add_argument("--rev", default="HEAD", help="FlashMLA's commit (default HEAD)")
    ap.add_argument("--cutlass", type=Path, required=True,
                    help="a git repository of CUTLASS holding the commit FlashMLA's submodule pins")
    ap.add_argument("--no-kv-loads", action="store_true",
                    help="timing-only: the main kernel copies no key tiles (output wrong by design)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    nvcc = "nvcc" if args.dry_run else B.find_nvcc()
    defines = ["-DFM_NO_KV_LOADS"] if args.no_kv_loads else []
    with tempfile.TemporaryDirectory(prefix="fm-src-") as tmp:
        root = Path(tmp)
        try:
            pins = extract(args.flashmla, args.rev, args.cutlass, root)
            kfile = root / "FlashMLA" / KERNEL_FILE
            kfile.write_text(edit_no_kv_loads(kfile.read_text()))  # the switch is inert without -DFM_NO_KV_LOADS
        except ValueError as e:
            print(f"build_fm_src: {e}", file=sys.stderr)
            return 2
        except SourceChanged as e:
            print(f"build_fm_src: {e}", file=sys.stderr)
            return 3
        out = args.out / LIB_NAME
        cmds, link = commands(root, out.resolve(), nvcc, defines)
        print(f"build_fm_src: FlashMLA {pins['flashmla'][:12]}, CUTLASS {pins['cutlass'][:12]} -> {out}"
              f" ({'no key loads' if args.no_kv_loads else 'as FlashMLA has it'})")
        if args.dry_run:
            for c in cmds + [link]:
                print(" ".join(c))
            return 0
        args.out.mkdir(parents=True, exist_ok=True)
        t = time.time()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(cmds)) as ex:
            runs = list(ex.map(lambda c: subprocess.run(c, capture_output=True, text=True), cmds))
        if all(r.returncode == 0 for r in runs):
            runs.append(subprocess.run(link, capture_output=True, text=True))
        log = "".join(r.stdout + r.stderr for r in runs)
        bad = [r for r in runs if r.returncode != 0]
        if bad:
            print(log[-6000:], file=sys.stderr)
            print(f"build_fm_src: nvcc failed (exit {bad[0].returncode})", file=sys.stderr)
            return 1
    kernels = B.parse_ptxas(log)
    for arch, ks in kernels.items():
        for name, v in ks.items():
            print(f"  {arch:8} {name[:60]:60} {v['registers']:4} regs  spills {v['spill_stores']}/{v['spill_loads']} B")
    meta = dict(pins, variant="no-kv-loads" if args.no_kv_loads else "as-is", flags=FLAGS + defines,
                sha256=hashlib.sha256(out.read_bytes()).hexdigest(), nvcc=B.nvcc_version(nvcc))
    (args.out / "build.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"build_fm_src: built in {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
