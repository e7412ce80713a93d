"""Build a variant of the kernel library for an A/B: a source tree's csrc/ with extra nvcc flags,
into a folder of its own (not build/lib, no stamp, no evidence), then print each kernel's
registers and spills per arch. The flags are the build gate's (kdtree_engine.kernel.build).

    python3 tools/build_variant.py build/lib/rul3 -- -Xptxas=--register-usage-level=3
    python3 tools/build_variant.py build/lib/j5 --root /tmp/wt-j5
    python3 tools/build_variant.py build/lib/nofx --root /tmp/wt-fx -- -DKDTREE_FIXUP=0
    python3 tools/build_variant.py build/lib/b16 --rev wip/r-bf16-partials -- -DKDTREE_PARTIALS_BF16=1

--root is the tree whose csrc/ is compiled (default: this checkout); --rev names a commit or branch
of this checkout instead, whose csrc/ is read from git (GitPython) into a temporary folder, so no
worktree and no working-tree state can stand in for it. Session Q's first A/B took
two "variants" built from the wrong tree, so the tool prints the csrc/ it compiles; check the
SASS for the change (cuobjdump -sass) before a GPU call. KDTREE_ARCHS picks the archs as for
the build gate. Exit 1 when nvcc fails, 3 when a kernel spills (the build gate refuses
spills; the library is still written, to be timed knowingly).

Several variants for one GPU call: build them into folders of a scratch directory, then
`tar -cJf build/variants.tar.xz -C <scratch> .` and carry build/variants.tar.xz; tools/gpu_session.sh
unpacks it into build/lib, so AB_LIBS names them build/lib/<v> as before.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kdtree_engine.kernel import build as B  # noqa: E402


def extract_csrc(repo: Path, rev: str, dest: Path) -> str:
    """Write csrc/ as commit ``rev`` of the git repository ``repo`` holds it into ``dest``/csrc;
    returns the commit's full sha. A ValueError names a rev git cannot resolve or a commit
    without csrc/."""
    try:
        import git  # GitPython
    except ImportError:
        raise ValueError("--rev reads git with GitPython, which this python lacks: "
                         "pip install GitPython (the project's `pipeline` extra)") from None
    try:
        commit = git.Repo(repo).commit(rev)
    except (git.BadName, ValueError, git.GitCommandError) as e:
        raise ValueError(f"--rev: {rev!r} is not a commit of {repo} ({e.__class__.__name__})") from None
    try:
        tree = commit.tree / "csrc"
    except KeyError:
        raise ValueError(f"--rev: commit {commit.hexsha[:12]} ({rev}) has no csrc/") from None
    for item in tree.traverse():
        if item.type == "blob":
            out = dest / item.path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(item.data_stream.read())
    return commit.hexsha


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="extra nvcc flags follow --")
    ap.add_argument("out", type=Path, help="folder for the variant's libkdtree_verify.so")
    ap.add_argument("--root", type=Path, default=None,
                    help="the source tree whose csrc/ is built (default: this checkout)")
    ap.add_argument("--rev", default=None,
                    help="build csrc/ of this commit or branch of the checkout (read from git), not a tree on disk")
    ap.add_argument("--dry-run", action="store_true", help="print the nvcc command only")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.extra = extra
    checkout = Path(__file__).resolve().parents[1]
    if args.rev is None:
        return build(args, (args.root or checkout).resolve())
    if args.root is not None:
        print("--rev and --root: give one of them", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="build-variant-") as tmp:
        try:
            sha = extract_csrc(checkout, args.rev, Path(tmp))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        print(f"build_variant: --rev {args.rev} is {sha}")
        return build(args, Path(tmp), f"--rev {args.rev}")


def build(args: argparse.Namespace, root: Path, source: str = "--root") -> int:
    if not (root / "csrc" / "kdtree_verify.cu").is_file():
        print(f"{source}: expected a source tree with csrc/kdtree_verify.cu, got {root}", file=sys.stderr)
        return 2
    archs = B.parse_archs(None)
    cmd = B.nvcc_command(root, args.out / B.LIB_NAME, archs, args.extra, "nvcc" if args.dry_run else B.find_nvcc())
    print(f"build_variant: csrc {root / 'csrc'} -> {args.out / B.LIB_NAME} ({', '.join(archs)}; extra: "
          f"{' '.join(args.extra) or 'none'})")
    if args.dry_run:  # the command names the sources relative to its working directory (B.SOURCE_PREFIX)
        keep = B.work_dir(args.out / B.LIB_NAME) / "keep"
        print(f"cd {shlex.quote(str(root))} && mkdir -p {shlex.quote(str(keep))} && {shlex.join(cmd)}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    r = B.run_nvcc(cmd, root)
    log = r.stdout + r.stderr
    if r.returncode != 0:
        print(log[-4000:], file=sys.stderr)
        print(f"build_variant: nvcc failed (exit {r.returncode})", file=sys.stderr)
        return 1
    kernels = B.parse_ptxas(log)
    result = B.BuildResult(args.out / B.LIB_NAME, True, archs, [], "", kernels)
    spilled = bool(B.spills(result))  # the gate's rules
    for k in B.serialized(result):
        print(f"  wgmma SERIALIZED by ptxas: {k} (the build gate refuses it)")
    for arch, ks in kernels.items():
        for name, v in ks.items():
            print(f"  {arch:8} {name:34} {v['registers']:4} regs  stack {v['stack']:3} B  "
                  f"spills {v['spill_stores']}/{v['spill_loads']} B")
    print(f"build_variant: built in {time.time() - t:.0f} s" + ("; SPILLS (the build gate refuses them)" if spilled else ""))
    return 3 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
