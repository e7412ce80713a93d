"""The ``integrate`` gate: SGLang's real Triton backend in TARGET_VERIFY, plugin off vs on.

``python -m kdtree_pipeline integrate [--quick] [--out DIR]`` runs two worker
processes, one with ``KDTREE_VERIFY=off`` and one with ``on``. Each loads
plugins the way SGLang does (``sglang.srt.plugins.load_plugins()`` through the
``sglang.srt.plugins`` entry point), builds SGLang's own MLA fixture with the
model-free kit it ships (``sglang.test.kits.attention_unittest``:
``MockMLAModelRunner``, ``MLATokenToKVPool``, ``ForwardBatch``,
``EagleVerifyInput``) at kv_lora_rank 512, rope 64, bf16, page size 1 with
fragmented slots, and runs the attention layer (``RadixAttention`` ->
``TritonAttnBackend.forward`` -> ``forward_extend``) on chain and tree masks,
bool and uint8, several batch sizes and prefix lengths up to 64k. It saves the
outputs and the pool (draft rows + a hash of every byte) per case, times the
layer call, and runs the kit's own ``run_mla_eagle_verify_case`` checks. The
parent compares: outputs within bf16 tolerance, pool bytes identical, every
"on" case served by the kernel, and writes the evidence record.

Entry point: when ``kdtree_verify`` is not discoverable through
``importlib.metadata`` (the GPU host has the package on ``PYTHONPATH``, not
pip-installed), the parent writes a minimal ``kdtree_engine-<ver>.dist-info``
(``METADATA`` + ``entry_points.txt``) into a temporary folder and puts it on the
workers' ``PYTHONPATH``; no pip and no network needed.

Stand-ins: the workers install :mod:`kdtree_pipeline.testing.standins` for
``sgl_kernel`` (and ``torchvision``) only when the real package is missing;
the evidence records whether they were used.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kdtree_pipeline.oracle import workloads

GATE = "integrate"
EP_GROUP = "sglang.srt.plugins"
EP_NAME = "kdtree_verify"
EP_VALUE = "kdtree_engine.sglang.plugin:load"
#: bf16's relative precision (torch.testing's bf16 rtol), applied at the output's scale.
RTOL = 1.6e-2


@dataclass(frozen=True)
class Case:
    """One TARGET_VERIFY batch: bs requests of n drafts each, h query heads."""

    name: str
    heads: int
    n: int
    prefix_lens: tuple[int, ...]
    mask: str  # "chain" | "tree"
    mask_dtype: str  # "bool" | "uint8"
    layout: str  # the kit's loc layout: "shuffled_pages" | "interleaved_pages"

    @property
    def bs(self) -> int:
        return len(self.prefix_lens)


CASES: tuple[Case, ...] = (
    Case("chain-bs1-h16-n8-p1000-bool", 16, 8, (1000,), "chain", "bool", "shuffled_pages"),
    Case("tree-bs4-h16-n16-ragged-bool", 16, 16, (0, 129, 4095, 777), "tree", "bool", "shuffled_pages"),
    Case("tree-bs4-h16-n16-ragged-uint8", 16, 16, (0, 129, 4095, 777), "tree", "uint8", "interleaved_pages"),
    Case("chain-bs2-h128-n4-uint8", 128, 4, (2048, 31), "chain", "uint8", "shuffled_pages"),
    Case("tree-bs8-h8-n16-p8k-uint8", 8, 16, (8192, 5000, 1, 7777, 4096, 300, 8000, 2500), "tree", "uint8",
         "interleaved_pages"),
    Case("tree-bs16-h16-n8-p2k-bool", 16, 8, (2048,) * 16, "tree", "bool", "interleaved_pages"),
    Case("tree-bs3-h32-n32-ragged-uint8", 32, 32, (5000, 1, 12000), "tree", "uint8", "shuffled_pages"),
    Case("tree-bs1-h8-n64-p32k-bool", 8, 64, (32768,), "tree", "bool", "shuffled_pages"),
    Case("chain-bs1-h8-n16-p64k-bool", 8, 16, (65536,), "chain", "bool", "shuffled_pages"),
    Case("tree-bs1-h16-n16-p64k-uint8", 16, 16, (65536,), "tree", "uint8", "shuffled_pages"),
)
QUICK = ("chain-bs1-h16-n8-p1000-bool", "tree-bs4-h16-n16-ragged-uint8", "chain-bs1-h8-n16-p64k-bool")
#: The kit's own end-to-end checks (k/v read back from the pool): (name, topk, n, prefix_lens,
#: cuda_graph). The cuda_graph ones capture TARGET_VERIFY through the backend's
#: init_forward_metadata_capture/replay_cuda_graph paths (batch padded to 4) and replay it.
KIT_CASES: tuple[tuple[str, int, int, tuple[int, ...], bool], ...] = (
    ("kit-chain-n4", 1, 4, (5, 19), False),
    ("kit-tree-n3", 2, 3, (3, 40), False),
    ("kit-graph-chain-n4", 1, 4, (5, 19), True),
    ("kit-graph-tree-n3", 2, 3, (3, 40), True),
)


def _src_root() -> Path:
    return Path(__file__).resolve().parents[2]


def ensure_entry_point(tmp: Path) -> tuple[str, Path | None]:
    """Make ``kdtree_verify`` discoverable in the workers. Returns (how, folder to add to
    PYTHONPATH or None)."""
    if any(ep.name == EP_NAME for ep in importlib.metadata.entry_points(group=EP_GROUP)):
        return "installed", None
    from kdtree_engine import __version__

    info = tmp / f"kdtree_engine-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kdtree-engine\nVersion: {__version__}\n")
    (info / "entry_points.txt").write_text(f"[{EP_GROUP}]\n{EP_NAME} = {EP_VALUE}\n")
    return "dist-info", tmp


# --- comparison (parent) ---------------------------------------------------------------


def compare_case(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """Outputs within bf16 tolerance at the output's scale; pool bytes identical;
    the drafts' KV was saved by both paths."""
    a, b = off["out"].float(), on["out"].float()
    problems = []
    if a.shape != b.shape:
        problems.append(f"output shapes differ: off {list(a.shape)}, on {list(b.shape)}")
        max_abs, scale = float("inf"), 0.0
    else:
        max_abs = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(a.abs().max()) if a.numel() else 0.0
        if not (torch.isfinite(b).all() and max_abs <= RTOL * scale + 1e-5):
            problems.append(f"outputs differ by {max_abs:.3g} at output scale {scale:.3g} (limit {RTOL} x scale)")
    if off["pool_sha256"] != on["pool_sha256"]:
        problems.append("KV pool bytes differ after the call")
    for mode, r in (("off", off), ("on", on)):
        if not r["draft_saved"]:
            problems.append(f"{mode}: the drafts' KV is not in the pool after the call")
    return {"ok": not problems, "problems": problems, "max_abs_diff": max_abs, "output_scale": scale,
            "off_us": off["us"], "on_us": on["us"],
            "speedup": off["us"] / on["us"] if on["us"] else None}


def compare_runs(off_dir: Path, on_dir: Path, require_cases: bool = True) -> tuple[bool, list[str], dict[str, Any]]:
    """Compare two workers' results; returns (passed, problems, per-case details)."""
    problems: list[str] = []
    s_off = json.loads((off_dir / "summary.json").read_text())
    s_on = json.loads((on_dir / "summary.json").read_text())
    if s_off["hooked"]:
        problems.append("KDTREE_VERIFY=off: the hook is installed (it must not be)")
    if not s_on["hooked"]:
        problems.append(f"KDTREE_VERIFY=on: the hook is not installed ({s_on['plugin'].get('reason')})")
    cases: dict[str, Any] = {}
    for name, on_case in s_on["cases"].items():
        off_case = s_off["cases"].get(name)
        if off_case is None:
            problems.append(f"{name}: missing from the off run")
            continue
        c = compare_case(torch.load(off_dir / f"{name}.pt"), torch.load(on_dir / f"{name}.pt"))
        c.update(off_case_info=off_case, on_case_info=on_case)
        if on_case.get("kernel_calls", 0) < 1 or on_case.get("fallbacks"):
            c["ok"] = False
            c["problems"].append(f"on: not served by the kernel (kernel calls {on_case.get('kernel_calls')}, "
                                 f"fallbacks {on_case.get('fallbacks')})")
        if off_case.get("kernel_calls"):
            c["ok"] = False
            c["problems"].append("off: the kernel ran")
        if on_case.get("repeat_equal") is False:  # (None: a worker from before this check)
            c["ok"] = False
            c["problems"].append("on: a later call of the same step (the next layer, reading the step plan) "
                                 "differs from the first")
        plans = on_case.get("plan_calls")
        if plans and plans["made"] and not plans["read"]:
            c["ok"] = False
            c["problems"].append(f"on: the step plan was made but no later call read it ({plans})")
        problems += [f"{name}: {p}" for p in c["problems"]]
        cases[name] = c
    for name, k_on in s_on["kit"].items():
        k_off = s_off["kit"].get(name, {"ok": False, "error": "missing from the off run"})
        if k_on.get("cuda_graph") and "checks" in k_on and "checks" in k_off:
            # SGLang's own graph path is the baseline: the plugin must give what it gives
            same, how = compare_kit_graph(name, off_dir, on_dir)
            k_on["vs_off"] = how
            if not same:
                problems.append(f"on: SGLang kit CUDA-graph case {name} differs from plugin-off: {how}")
            if not k_on["ok"] and k_off["ok"]:
                problems.append(f"on: SGLang kit check {name} failed only with the plugin: {k_on['error']}")
            if not k_off["ok"]:
                k_on["note"] = ("SGLang's own reference check of this case fails with the plugin off too: "
                                f"{k_off['error']}")
        else:
            for mode, k in (("off", k_off), ("on", k_on)):
                if not k["ok"]:
                    problems.append(f"{mode}: SGLang kit check {name} failed: {k['error']}")
        if "kernel_calls" in k_on and not k_on["kernel_calls"]:
            problems.append(f"on: SGLang kit check {name} ran without the kernel (0 kernel calls)")
    if not cases and require_cases:
        problems.append("no case ran")
    return not problems, problems, {"cases": cases, "kit": {"off": s_off["kit"], "on": s_on["kit"]},
                                    "standins": {"off": s_off["standins"], "on": s_on["standins"]},
                                    "plugin_on": s_on["plugin"]}


# --- the gate (parent) -----------------------------------------------------------------


def _run_worker(mode: str, out: Path, quick: bool, extra_path: Path | None, timeout: float,
                kit_graph_only: bool = False) -> tuple[int, str]:
    env = dict(os.environ)
    env["KDTREE_VERIFY"] = mode
    env.pop("SGLANG_PLUGINS", None)
    paths = [str(p) for p in (extra_path, _src_root()) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "kdtree_pipeline.integrate", "--worker", "--out", str(out)]
    if quick:
        cmd.append("--quick")
    if kit_graph_only:
        cmd.append("--kit-graph-only")
    out.mkdir(parents=True, exist_ok=True)
    log = out / "worker.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return rc, "\n".join(tail)


def run_off_on(out: Path, quick: bool, timeout: float, kit_graph_only: bool = False) -> tuple[str, str | None]:
    """Run the KDTREE_VERIFY=off then =on worker processes into out/off and out/on.
    Returns (how the entry point was made discoverable, failure text or None)."""
    with tempfile.TemporaryDirectory(prefix="kdtree-ep-") as tmp:
        how, extra = ensure_entry_point(Path(tmp))
        for mode in ("off", "on"):
            rc, tail = _run_worker(mode, out / mode, quick, extra, timeout, kit_graph_only)
            if rc != 0:
                return how, f"the KDTREE_VERIFY={mode} worker exited with {rc}; last lines:\n{tail}"
    return how, None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m kdtree_pipeline integrate", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="folder for worker outputs (default build/integrate)")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} and the kit checks")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per worker process")
    args = p.parse_args(argv)
    from kdtree_pipeline.evidence import make_record, repo_root, write_record

    out = args.out or repo_root() / "build" / "integrate"
    if not torch.cuda.is_available():
        reason = "the integrate gate needs a CUDA GPU and torch sees none (torch.cuda.is_available() is False)"
        print(f"integrate: FAIL: {reason}")
        write_record(make_record(GATE, False, {}, "not run: no CUDA GPU", reason=reason, device=None))
        return 1
    t0 = time.time()
    how, failure = run_off_on(out, args.quick, args.timeout)
    if failure:
        print(f"integrate: FAIL: {failure}")
        write_record(make_record(GATE, False, {}, "worker failed", reason=failure,
                                 details={"entry_point": how}))
        return 1
    passed, problems, details = compare_runs(out / "off", out / "on")
    cases = details["cases"]
    speedups = {n: c["speedup"] for n, c in cases.items() if c["speedup"]}
    worst = max((c["max_abs_diff"] / c["output_scale"] for c in cases.values() if c["output_scale"]), default=0.0)
    long_ctx = [n for n in cases if "64k" in n]
    headline = (
        f"{sum(c['ok'] for c in cases.values())}/{len(cases)} TARGET_VERIFY cases agree (max rel diff {worst:.2e}), "
        f"pool identical; eager per-layer call (host-bound: launches and metadata included; "
        f"`bench --suite graph` times the kernel) "
        + ", ".join(f"{n}: {cases[n]['off_us']:.0f} -> {cases[n]['on_us']:.0f} us" for n in long_ctx[:2])
    )
    metrics = {
        "cases": len(cases),
        "cases_ok": sum(c["ok"] for c in cases.values()),
        "max_rel_diff": worst,
        "per_layer_us": {n: {"off": c["off_us"], "on": c["on_us"]} for n, c in cases.items()},
        "speedup_min": min(speedups.values(), default=None),
        "speedup_max": max(speedups.values(), default=None),
        "kit_checks_ok": all(k["ok"] for m in details["kit"].values() for k in m.values()),
    }
    details.update(entry_point=how, problems=problems, seconds=round(time.time() - t0, 1), quick=args.quick)
    record = make_record(GATE, passed, metrics, headline, reason="; ".join(problems[:5]) or None,
                         variant="quick" if args.quick else None, details=_jsonable(details))
    path = write_record(record)
    print(f"integrate: {'PASS' if passed else 'FAIL'}: {headline}")
    print(f"{'case':40s} {'off us':>10s} {'on us':>10s} {'x':>7s}  ok")
    for n, c in cases.items():
        print(f"{n:40s} {c['off_us']:10.1f} {c['on_us']:10.1f} {c['speedup'] or 0:7.1f}  {c['ok']}")
    for prob in problems:
        print(f"  - {prob}")
    print(f"evidence: {path}")
    return 0 if passed else 1


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and x != x:
        return None
    return x


# --- the worker (one process per mode) -----------------------------------------------------


def tree_parents(case: Case, seed: int) -> list[int]:
    """Parent of each draft (-1 for the root): a chain, or a seeded random tree in
    topological order (a parent precedes its children)."""
    if case.mask == "chain":
        return workloads.chain(case.n)
    return workloads.random_tree(case.n, torch.Generator().manual_seed(seed))


def full_mask(case: Case, seed: int, device: str) -> torch.Tensor:
    """SGLang's FULL_MASK for the batch: per request n rows x (prefix + n) columns, flat."""
    parents = tree_parents(case, seed)
    flat = torch.cat([workloads.full_mask(parents, L).reshape(-1) for L in case.prefix_lens]).to(device)
    return flat if case.mask_dtype == "bool" else flat.to(torch.uint8)


def _pool_sha256(pool: torch.Tensor) -> str:
    data = pool.contiguous().view(torch.int16).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class _KitTestCase:
    """What the kit's helpers need from a unittest.TestCase."""

    def skipTest(self, reason: str) -> None:  # noqa: N802 - unittest's name
        raise RuntimeError(f"SGLang's kit skipped the case: {reason}")


def _run_case(case: Case, index: int, out: Path, plugin_status: Any) -> dict[str, Any]:
    import triton.testing
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
        MLAAttentionCase,
        build_mla_attention_fixture,
    )
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        _make_spec_verify_input,
        _prepare_target_verify_batch,
    )

    mcase = MLAAttentionCase(name=f"kdtree_{case.name}", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
                             num_heads=case.heads, page_size=1, prefix_lens=case.prefix_lens,
                             extend_lens=(case.n,) * case.bs)
    ctx = -(-(max(case.prefix_lens) + case.n) // 64) * 64
    fx = build_mla_attention_fixture(_KitTestCase(), mcase, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=64,
                                     max_context_len=ctx, dtype=torch.bfloat16, device="cuda",
                                     loc_layout=case.layout)
    fb, backend, layer = fx.forward_batch, fx.backend, fx.actual_module.attn_mqa
    _prepare_target_verify_batch(fb, mcase, "cuda")
    fb.spec_info = _make_spec_verify_input(mcase, fb, topk=1, device="cuda", spec_kind="eagle")
    fb.spec_info.custom_mask = full_mask(case, 1000 + index, "cuda")
    g = torch.Generator(device="cuda").manual_seed(2000 + index)
    T = case.bs * case.n
    q = torch.randn(T, case.heads * 576, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(T, 1, 576, generator=g, device="cuda").to(torch.bfloat16)
    v = k[..., :512]
    before = plugin_status() if plugin_status else None
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(fb)
        o = layer(q, k, v, fb, save_kv_cache=True)
        torch.cuda.synchronize()
        after = plugin_status() if plugin_status else None
        pool = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
        draft_rows = pool[fb.out_cache_loc]
        result = {
            "out": o.detach().cpu(),
            "draft_rows": draft_rows.cpu(),
            "draft_saved": bool(torch.equal(draft_rows, k)),
            "pool_sha256": _pool_sha256(pool),
        }
        first = o.clone()
        ms = triton.testing.do_bench(lambda: layer(q, k, v, fb, save_kv_cache=True), warmup=25, rep=200,
                                     return_mode="median")
        # the step's next layer, as it would run after the first: with the plugin, it reads the
        # step plan the first call made (the timed calls above read it too)
        again = layer(q, k, v, fb, save_kv_cache=True)
        torch.cuda.synchronize()
        after_all = plugin_status() if plugin_status else None
    result["us"] = ms * 1e3
    torch.save(result, out / f"{case.name}.pt")
    info = {"us": result["us"], "out_shape": list(o.shape), "out_dtype": str(o.dtype),
            "draft_saved": result["draft_saved"], "repeat_equal": bool(torch.equal(again, first))}
    if before is not None and after is not None:
        info["kernel_calls"] = after["kernel_calls"] - before["kernel_calls"]
        if "plan_calls" in after_all:
            info["plan_calls"] = {k: after_all["plan_calls"][k] - before["plan_calls"][k] for k in ("made", "read")}
        info["fallbacks"] = {r: n - before["fallbacks"].get(r, 0) for r, n in after["fallbacks"].items()
                             if n != before["fallbacks"].get(r, 0)}
    del fx, pool
    torch.cuda.empty_cache()
    return info


def _run_kit(name: str, topk: int, n: int, prefix_lens: tuple[int, ...], cuda_graph: bool,
             status: Any, out: Path) -> dict[str, Any]:
    """One of the kit's own checks. For the CUDA-graph ones every comparison the kit
    makes (graph-eager vs reference, replay vs reference, replay vs graph-eager) is
    recorded instead of raised, with the tensor it checked, so that plugin-on can be
    compared with plugin-off output for output (out/<name>-kit.pt)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import MLAAttentionCase
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        run_mla_eagle_verify_case,
        run_mla_eagle_verify_cuda_graph_case,
    )

    mcase = MLAAttentionCase(name=name, backend="triton", forward_mode=ForwardMode.TARGET_VERIFY, num_heads=16,
                             page_size=1, prefix_lens=prefix_lens, extend_lens=(n,) * len(prefix_lens))
    run = run_mla_eagle_verify_cuda_graph_case if cuda_graph else run_mla_eagle_verify_case
    before = status()["kernel_calls"] if status else 0
    checks: list[dict[str, Any]] = []
    actuals: list[torch.Tensor] = []
    real_assert_close = torch.testing.assert_close

    def record(actual, expected, *a, **kw):
        try:
            real_assert_close(actual, expected, *a, **kw)
            checks.append({"ok": True, "error": None})
        except AssertionError as e:
            checks.append({"ok": False, "error": " ".join(str(e).split())[:300]})
        actuals.append(actual.detach().float().cpu())

    if cuda_graph:
        torch.testing.assert_close = record
    try:
        run(_KitTestCase(), mcase, topk=topk, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
            device="cuda")
    except Exception as e:  # noqa: BLE001 - recorded as a failed check
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "cuda_graph": cuda_graph}
    finally:
        torch.testing.assert_close = real_assert_close
    calls = (status()["kernel_calls"] - before) if status else 0
    if cuda_graph:
        torch.save(actuals, out / f"{name}-kit.pt")
        bad = [c["error"] for c in checks if not c["ok"]]
        return {"ok": not bad and bool(checks), "error": bad[0] if bad else None, "cuda_graph": True,
                "kernel_calls": calls, "checks": checks}
    return {"ok": True, "error": None, "cuda_graph": False, "kernel_calls": calls}


def compare_kit_graph(name: str, off_dir: Path, on_dir: Path) -> tuple[bool, str]:
    """Plugin-on vs plugin-off, tensor for tensor, for one kit CUDA-graph case."""
    a = torch.load(off_dir / f"{name}-kit.pt")
    b = torch.load(on_dir / f"{name}-kit.pt")
    if len(a) != len(b) or not a:
        return False, f"{len(a)} checked outputs off, {len(b)} on"
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or not torch.isfinite(y).all():
            return False, f"output shapes {list(x.shape)} vs {list(y.shape)} or non-finite output"
        scale = float(x.abs().max()) or 1.0
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst <= RTOL, f"max diff {worst:.2e} x output scale over {len(a)} outputs"


def worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kdtree_pipeline.integrate --worker")
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kit-graph-only", action="store_true", help="only the kit's CUDA-graph checks (graph gate)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kdtree_pipeline.testing import standins as _standins

    standins = {"sgl_kernel": _standins.install_sgl_kernel_standin(),
                "torchvision": _standins.install_torchvision_standin()}
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as SGLang does in every process; picks up kdtree_verify via its entry point
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from kdtree_engine.sglang import plugin

    hooked = hasattr(TritonAttnBackend.__dict__["forward_extend"], "__wrapped__")
    summary: dict[str, Any] = {"mode": os.environ.get("KDTREE_VERIFY"), "hooked": hooked, "standins": standins,
                               "cases": {}, "kit": {}}
    cases = [] if args.kit_graph_only else [c for c in CASES if not args.quick or c.name in QUICK]
    status = plugin.status if hooked else None
    for i, case in enumerate(cases):
        info = _run_case(case, i, args.out, status)
        summary["cases"][case.name] = info | {"case": asdict(case)}
        logging.info("case %s: %.1f us %s", case.name, info["us"], info.get("fallbacks") or "")
    for name, topk, n, lens, graph in KIT_CASES:
        if graph or not args.kit_graph_only:
            summary["kit"][name] = _run_kit(name, topk, n, lens, graph, status, args.out)
    summary["plugin"] = plugin.status()
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
