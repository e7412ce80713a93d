"""FlashMLA's dense decode built from source (tools/build_fm_src.py) as a bench peer, for the tools only.

``--fm-src LABEL=DIR`` (tools/ab_bench.py, tools/clock_probe.py) registers the library DIR/libfm_dense.so
as the system LABEL, beside the bench's own peers, for that process only: `nox -s bench` never sees it.
The peer is called as the bench's ``flashmla`` is (bench/peers.py): the same paged chain cache
(``paged_chain_cache``, same seed, so the same pages in the same order), FlashMLA's tile schedule made
once in ``prepare`` (the wheel's ``get_mla_metadata``), and each timed call runs FlashMLA's main kernel
and its combine. So LABEL built as FlashMLA has it must time as ``flashmla`` does in the same process
(the check that the build is the bench's peer), and a timing-only build (``--no-kv-loads``) is timed
on the same inputs; its output is wrong by design and the bench's check says so.

FlashMLA's host code ends the process (exit 1) on a CUDA error, as it does under torch.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

LIB_NAME = "libfm_dense.so"


def add_argument(ap) -> None:
    """The ``--fm-src`` flag of the tools that take these peers (ab_bench.py, clock_probe.py)."""
    ap.add_argument("--fm-src", action="append", default=[], metavar="LABEL=DIR",
                    help="time FlashMLA built from source (tools/build_fm_src.py) in DIR as system LABEL "
                         "(tools/fm_src_peer.py; repeatable)")


def parse_spec(spec: str, taken) -> tuple[str, Path]:
    """``LABEL=DIR`` -> (label, DIR/libfm_dense.so); a ValueError names what is wrong."""
    label, sep, folder = spec.partition("=")
    label = label.strip()
    if not sep or not label or not folder.strip():
        raise ValueError(f"--fm-src: expected LABEL=DIR (a build_fm_src.py folder), got {spec!r}")
    if label in taken:
        raise ValueError(f"--fm-src: {label!r} is already a system's name; choose another label")
    path = Path(folder.strip())
    if path.suffix == ".so" and path.name != LIB_NAME:
        raise ValueError(f"--fm-src {label}: expected a folder holding {LIB_NAME}, got {folder!r}")
    return label, path if path.name == LIB_NAME else path / LIB_NAME


def register(specs: list[str]) -> list[str]:
    """Add one peer per ``LABEL=DIR`` to bench.peers.PEERS (this process only); returns the labels.
    A ValueError for a malformed or duplicate spec, before anything is registered."""
    from kdtree_pipeline.bench.peers import PEERS

    parsed: list[tuple[str, Path]] = []
    for s in specs:
        label, path = parse_spec(s, set(PEERS) | {lab for lab, _ in parsed})
        parsed.append((label, path))
    for label, path in parsed:
        PEERS[label] = make_peer(label, path)
    return [label for label, _ in parsed]


def make_peer(label: str, path: Path):
    from kdtree_pipeline.bench import peers

    class FlashMLASource(peers.Peer):
        name = label
        supports_trees = False

        def __init__(self) -> None:
            self.label = f"FlashMLA from source ({path.parent.name})"
            self.path = path
            self._lib = None

        def lib(self):
            if self._lib is None:
                lib = ctypes.CDLL(str(self.path))
                vp, ip, fp = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
                lib.fm_src_meta_ints.restype = ctypes.c_int
                lib.fm_src_num_sm_parts.argtypes = [ctypes.c_int] * 3
                lib.fm_src_sched.argtypes = [ctypes.c_int, ctypes.c_int, ip, ip, ip, ctypes.c_int, vp]
                lib.fm_src_decode.argtypes = ([ctypes.c_int] * 5 + [ctypes.c_float] + [vp, vp, ip, ip, ip, ip]
                                              + [ctypes.c_int] + [vp, fp, fp, fp, vp])
                self._lib = lib
            return self._lib

        def check(self) -> str | None:
            import torch

            if not self.path.is_file():
                return f"{self.path}: no such library (tools/build_fm_src.py builds it)"
            if not torch.cuda.is_available():
                return "needs a CUDA GPU"
            cap = torch.cuda.get_device_capability()
            if cap != (9, 0):
                return f"built for sm_90a only; this GPU is sm_{cap[0]}{cap[1]}"
            try:
                self.lib()
            except OSError as e:
                return f"OSError: {e}"
            return None

        def prepare(self, batch):
            import torch

            ns = set(batch.n_drafts)
            if len(ns) != 1:
                raise peers.PeerUnsupported("FlashMLA's q [b, s_q, h, 576] needs the same draft count in every request")
            n = ns.pop()
            bs, H, D = batch.bs, batch.q.shape[1], batch.q.shape[2]
            q4 = batch.q.view(bs, n, H, D)
            k_cache, table, seqlens = peers.paged_chain_cache(batch)
            lib, dev = self.lib(), batch.q.device
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            parts = lib.fm_src_num_sm_parts(sms, n, H)
            sched = torch.empty((parts, lib.fm_src_meta_ints()), dtype=torch.int32, device=dev)
            splits = torch.empty((bs + 1,), dtype=torch.int32, device=dev)
            stream = torch.cuda.current_stream().cuda_stream
            if lib.fm_src_sched(bs, n, seqlens.data_ptr(), sched.data_ptr(), splits.data_ptr(), parts, stream):
                raise RuntimeError(f"{label}: FlashMLA's schedule kernel failed to launch")
            rows = n * H
            out = torch.full((bs, n, H, peers.V_DIM), float("nan"), dtype=torch.bfloat16, device=dev)
            lse = torch.empty((bs, rows), dtype=torch.float32, device=dev)
            lse_acc = torch.empty((bs + parts, rows), dtype=torch.float32, device=dev)
            o_acc = torch.empty((bs + parts, rows, peers.V_DIM), dtype=torch.float32, device=dev)
            args = (bs, n, H, k_cache.shape[0], table.shape[1], batch.sm_scale,
                    q4.data_ptr(), k_cache.data_ptr(), table.data_ptr(), seqlens.data_ptr(),
                    sched.data_ptr(), splits.data_ptr(), parts,
                    out.data_ptr(), lse.data_ptr(), lse_acc.data_ptr(), o_acc.data_ptr())
            keep = (q4, k_cache, table, seqlens, sched, splits, lse, lse_acc, o_acc)

            def run():
                if lib.fm_src_decode(*args, torch.cuda.current_stream().cuda_stream):
                    raise RuntimeError(f"{label}: FlashMLA's decode failed to launch")
                return out

            run.keep = keep  # the buffers the library reads, alive while run is
            return run

    return FlashMLASource()
