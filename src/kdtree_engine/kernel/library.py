"""ctypes binding of the kernel library's C ABI (csrc/kdtree_verify.h).

The library is built by the ``build`` gate (:mod:`kdtree_engine.kernel.build`)
with a static CUDA runtime, so it loads through ctypes in any Python (loading needs
no GPU; running needs a CUDA driver). Found as: ``KDTREE_LIB`` if set, else the
copy a wheel ships in ``kdtree_engine/_lib/``, else the checkout's ``build/lib``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

# the target is an argument of verify_attention: refused in that op's one error form
from kdtree_engine.kernel.errors import VerifyArgumentError, argument_error

ABI_VERSION = 3
#: ABI 2 libraries (before the step plan) still load, for A/B runs against older builds: their
#: argument struct is ABI 3's without its last fields, and ``Library.has_plan`` is False.
OLDEST_ABI = 2
LIB_NAME = "libkdtree_verify.so"

OK, EINVAL, ECUDA, ENOARCH = 0, 1, 2, 3
ERR_BITS = {
    1: "a slot id in kv_indices is outside the KV pool",
    2: "kv_indptr is not monotone or runs past kv_indices",
    4: "qo_indptr is not monotone, runs past the token count, or a request has more drafts than max_n",
    8: "a request's mask rows run past the end of custom_mask (mask_indptr or prefix lengths wrong)",
    16: "the step plan was made for another batch shape or other lengths than this call's (make it again "
        "with make_plan=True on the step's first call)",
}


#: ``target`` / ``KDTREE_TARGET`` values -> the C ABI's KDTREE_TARGET_*
TARGETS = {"native": 0, "sm_120": 120}


def resolve_target(target: str | None) -> int:
    """``target`` (or, when None, ``KDTREE_TARGET``; unset or empty = native) -> the ABI code.

    ``sm_120`` runs exactly what an sm_120 GPU (RTX PRO 6000 Blackwell) runs, under its
    limits, on a GPU of compute capability >= 9.0; a real sm_120 ignores it."""
    if target is None:
        raw = os.environ.get("KDTREE_TARGET", "").strip() or "native"
        if raw not in TARGETS:
            raise VerifyArgumentError(f"KDTREE_TARGET: expected one of {', '.join(TARGETS)} (or unset), got {raw!r}")
        return TARGETS[raw]
    if target not in TARGETS:
        raise argument_error("target", f"one of {', '.join(TARGETS)} or None (KDTREE_TARGET)", repr(target))
    return TARGETS[target]


class KernelLibraryError(RuntimeError):
    """The kernel library is missing, fails to load, or speaks another ABI."""


class KdtreeVerifyArgs(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("q", ctypes.c_void_p),
        ("q_stride_tok", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("k_ext", ctypes.c_void_p),
        ("k_ext_stride_tok", ctypes.c_int64),
        ("draft_slots", ctypes.c_void_p),
        ("draft_slots_is_64", ctypes.c_int32),
        ("kv", ctypes.c_void_p),
        ("kv_stride_slot", ctypes.c_int64),
        ("pool_size", ctypes.c_int64),
        ("qo_indptr", ctypes.c_void_p),
        ("kv_indptr", ctypes.c_void_p),
        ("qo_indptr_is_64", ctypes.c_int32),
        ("kv_indptr_is_64", ctypes.c_int32),
        ("kv_indices", ctypes.c_void_p),
        ("kv_indices_is_64", ctypes.c_int32),
        ("kv_indices_len", ctypes.c_int64),
        ("mask", ctypes.c_void_p),
        ("mask_indptr", ctypes.c_void_p),
        ("mask_len", ctypes.c_int64),
        ("o", ctypes.c_void_p),
        ("o_stride_tok", ctypes.c_int64),
        ("o_stride_head", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("bs", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("max_n", ctypes.c_int32),
        ("total_tokens", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("sm_scale", ctypes.c_float),
        ("target", ctypes.c_int32),
        # ABI 3: the step plan
        ("plan_mode", ctypes.c_int32),
        ("plan", ctypes.c_void_p),
        ("plan_bytes", ctypes.c_int64),
    ]


#: plan_mode values (KDTREE_PLAN_*)
PLAN_NONE, PLAN_MAKE, PLAN_USE = 0, 1, 2


#: kernels, tiles and targets of csrc/kdtree_verify.h
KERNEL_SM90, KERNEL_MMA = 1, 2
TILE_SM90_64X64, TILE_MMA_64X32_QREG = 1, 2
TARGET_NATIVE, TARGET_SM120 = 0, 120
CFG_HAS_SM90A, CFG_FORCE_MMA = 1, 2


class KdtreeDeviceProps(ctypes.Structure):
    """What the choice of kernel and tile reads of a device."""

    _fields_ = [
        ("cc_major", ctypes.c_int32),
        ("cc_minor", ctypes.c_int32),
        ("sm_count", ctypes.c_int32),
        ("max_threads_per_sm", ctypes.c_int32),
        ("smem_per_block_optin", ctypes.c_int64),
        ("smem_per_sm", ctypes.c_int64),
    ]


class KdtreeConfig(ctypes.Structure):
    """The kernel and tile a device gets (kdtree_choose_config)."""

    _fields_ = [
        ("kernel", ctypes.c_int32),
        ("tile", ctypes.c_int32),
        ("block_rows", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("smem_bytes", ctypes.c_int32),
        ("smem_request", ctypes.c_int32),
        ("ctas_per_sm", ctypes.c_int32),
        ("emulated", ctypes.c_int32),
        ("target_cc", ctypes.c_int32),
        ("name", ctypes.c_char * 48),
        ("note", ctypes.c_char * 200),
    ]

    def as_dict(self) -> dict:
        d = {name: getattr(self, name) for name, _ in self._fields_}
        d["name"], d["note"] = self.name.decode(), self.note.decode()
        return d


def bind_choose_config(lib: ctypes.CDLL):
    """Type ``kdtree_choose_config`` of a loaded library (the full one, or config.cc alone)."""
    fn = lib.kdtree_choose_config
    fn.argtypes = [ctypes.POINTER(KdtreeDeviceProps), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                   ctypes.POINTER(KdtreeConfig)]
    fn.restype = ctypes.c_int
    return fn


#: Where a wheel ships the library (``setup.py`` builds it into the package).
PACKAGED = Path(__file__).resolve().parents[1] / "_lib" / LIB_NAME


def source_root() -> Path:
    """The source tree this package sits in (a checkout, or an editable install of one): the
    folder holding ``csrc/`` two levels above the package. Raises :class:`KernelLibraryError` for an
    installed wheel, which ships its library and has no sources to build."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "csrc").is_dir():
        raise KernelLibraryError(f"no csrc/ beside this kdtree_engine ({root}): an installed wheel ships "
                                 "its library and builds nothing; build from a checkout, or set KDTREE_LIB")
    return root


def default_out_dir(root: Path | None = None) -> Path:
    """The library's folder: ``KDTREE_BUILD_DIR`` (an explicit choice wins, as KDTREE_LIB does
    for the file), else build/lib of ``root`` (default: the checkout around the working
    directory). One rule for the build gate, the loader and a record's provenance, so that a
    record names the file the gate loaded."""
    env = os.environ.get("KDTREE_BUILD_DIR")
    if env:
        return Path(env)
    return Path(root or source_root()) / "build" / "lib"


def default_library_path(root: Path | None = None) -> Path:
    """``KDTREE_LIB`` (an explicit choice wins), else the library packaged in the wheel,
    else the one in the build gate's folder, ``:func:`default_out_dir``` (editable
    installs, ``python -m kdtree_pipeline build``): ``root``'s build/lib when given."""
    env = os.environ.get("KDTREE_LIB")
    if env:
        return Path(env)
    if PACKAGED.is_file():
        return PACKAGED
    try:
        return default_out_dir(root) / LIB_NAME
    except Exception as e:  # noqa: BLE001 - no checkout around (an installed wheel without its library)
        raise KernelLibraryError(
            f"no kernel library: none packaged at {PACKAGED} and no kdtree-engine checkout to find "
            f"build/lib in ({e}); install the wheel (it ships the library) or set KDTREE_LIB"
        ) from None


STAMP_SUFFIX = ".stamp.json"  # the build's stamp beside the library (kernel.build)


class Library:
    """The loaded shared library with typed entry points."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise KernelLibraryError(
                f"kernel library {self.path} does not exist; build it with `nox -s build` "
                "(or `python -m kdtree_pipeline build`), or point KDTREE_LIB at a build"
            )
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise KernelLibraryError(f"cannot load kernel library {self.path}: {e}") from None
        lib.kdtree_abi_version.restype = ctypes.c_int
        lib.kdtree_last_error.restype = ctypes.c_char_p
        lib.kdtree_build_info.restype = ctypes.c_char_p
        self._choose = bind_choose_config(lib)
        lib.kdtree_device_config.argtypes = [ctypes.c_int, ctypes.c_int32, ctypes.POINTER(KdtreeConfig)]
        lib.kdtree_device_config.restype = ctypes.c_int
        lib.kdtree_workspace_bytes.argtypes = [ctypes.c_int64, ctypes.c_int32]
        lib.kdtree_workspace_bytes.restype = ctypes.c_int64
        lib.kdtree_verify_attn.argtypes = [ctypes.POINTER(KdtreeVerifyArgs), ctypes.c_void_p]
        lib.kdtree_verify_attn.restype = ctypes.c_int
        lib.kdtree_read_device_error.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
        lib.kdtree_read_device_error.restype = ctypes.c_int
        # absent from libraries built before the contiguous fast path (A/B runs load those)
        self._has_fast_path_count = hasattr(lib, "kdtree_read_fast_path_boxes")
        if self._has_fast_path_count:
            lib.kdtree_read_fast_path_boxes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
            lib.kdtree_read_fast_path_boxes.restype = ctypes.c_int
        abi = lib.kdtree_abi_version()
        if not OLDEST_ABI <= abi <= ABI_VERSION:
            raise KernelLibraryError(
                f"kernel library {self.path} speaks ABI {abi}, this binding speaks {OLDEST_ABI}..{ABI_VERSION}; "
                "rebuild it"
            )
        #: the ABI the library speaks (the argument struct's abi_version)
        self.abi = abi
        #: whether it takes a step plan (ABI 3)
        self.has_plan = abi >= 3
        if self.has_plan:
            lib.kdtree_plan_bytes.restype = ctypes.c_int64
            self.plan_bytes = int(lib.kdtree_plan_bytes())
        else:
            self.plan_bytes = 0
        self._lib = lib
        self.archs = lib.kdtree_build_info().decode()
        self._configs: dict[tuple[int, int], KdtreeConfig] = {}

    def last_error(self) -> str:
        return (self._lib.kdtree_last_error() or b"").decode()

    def device_config(self, device: int, target: int | None = None) -> KdtreeConfig:
        """The kernel and tile a call with ``target`` gets on ``device`` (cached: device
        properties and the KDTREE_KERNEL switch are read once). ``target``
        None: the op's default, KDTREE_TARGET."""
        if target is None:
            target = resolve_target(None)
        key = (device, target)
        if key not in self._configs:
            cfg = KdtreeConfig()
            rc = self._lib.kdtree_device_config(device, target, ctypes.byref(cfg))
            if rc != OK:
                raise KernelLibraryError(f"kdtree: no configuration for device {device}, target {target}: "
                                         f"{self.last_error()}")
            self._configs[key] = cfg
        return self._configs[key]

    def choose_config(self, props: KdtreeDeviceProps, target: int = TARGET_NATIVE, flags: int = 0,
                      tile: int = 0) -> tuple[int, KdtreeConfig]:
        """The pure configuration choice for ``props`` (no CUDA call): (return code, config)."""
        cfg = KdtreeConfig()
        rc = self._choose(ctypes.byref(props), target, flags, tile, ctypes.byref(cfg))
        return int(rc), cfg

    def kernel_name(self, device: int, target: int | None = None) -> str:
        """The kernel and tile that run on ``device`` (e.g. wgmma-sm90a-seesaw-64x64)."""
        return self.device_config(device, target).name.decode()

    def block_rows(self, device: int, target: int | None = None) -> int:
        return int(self.device_config(device, target).block_rows)

    def workspace_bytes(self, total_rows: int, num_splits: int) -> int:
        return int(self._lib.kdtree_workspace_bytes(total_rows, num_splits))

    def verify_attn(self, args: KdtreeVerifyArgs, stream: int) -> int:
        return int(self._lib.kdtree_verify_attn(ctypes.byref(args), ctypes.c_void_p(stream)))

    def read_device_error(self, workspace_ptr: int, stream: int) -> int:
        """Error bits the calls on this workspace set since the last read (clears them; synchronises)."""
        bits = ctypes.c_int32(0)
        rc = self._lib.kdtree_read_device_error(ctypes.c_void_p(workspace_ptr), ctypes.c_void_p(stream), ctypes.byref(bits))
        if rc != OK:
            raise RuntimeError(f"kdtree: {self.last_error()}")
        return bits.value

    def read_fast_path_boxes(self, workspace_ptr: int, stream: int) -> int:
        """Blocks of 32 key rows that the calls on this workspace since the last read loaded
        through the contiguous fast path (TMA boxes instead of the row gather; clears the
        count; synchronises)."""
        if not self._has_fast_path_count:
            raise KernelLibraryError(f"kernel library {self.path} has no kdtree_read_fast_path_boxes; rebuild it")
        boxes = ctypes.c_int32(0)
        rc = self._lib.kdtree_read_fast_path_boxes(ctypes.c_void_p(workspace_ptr), ctypes.c_void_p(stream),
                                                   ctypes.byref(boxes))
        if rc != OK:
            raise RuntimeError(f"kdtree: {self.last_error()}")
        return boxes.value


_lock = threading.Lock()
_cache: dict[Path, Library] = {}


_default: Library | None = None


def load(path: Path | str | None = None) -> Library:
    """Load (once per path) and return the kernel library. The default one is
    resolved once per process: this sits on the per-call path of the op."""
    global _default
    if path is None and _default is not None:
        return _default
    p = Path(path) if path is not None else default_library_path()
    with _lock:
        if p not in _cache:
            _cache[p] = Library(p)
        if path is None:
            _default = _cache[p]
        return _cache[p]


def describe_device_error(bits: int) -> str:
    return "; ".join(msg for bit, msg in ERR_BITS.items() if bits & bit) or f"unknown bits {bits:#x}"
