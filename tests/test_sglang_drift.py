"""The plugin against whichever SGLang release is installed (CPU): every name the hooked path
reads is there, the hooked signature matches, and the KV write location is built the way that
release's own ``forward_extend`` builds it.

``nox -s tests`` runs this on SGLang 0.5.23 with the rest of the suite; ``nox -s drift`` runs it
again on each end of the supported range (0.5.17 and 0.5.23), SGLang installed ``--no-deps``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kdtree_engine.sglang import drift, fallback, plugin
from kdtree_pipeline.testing import standins as _standins

_standins.install_torchvision_standin()  # CPU torch cannot load the CUDA torchvision wheels
if torch.cuda.is_available():
    _standins.install_sgl_kernel_standin()

import sglang  # noqa: E402
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import KVWriteLoc  # noqa: E402

pytestmark = pytest.mark.sglang


def test_this_release_is_in_the_supported_range_and_has_what_the_hook_reads():
    assert fallback.in_supported_range(sglang.__version__), sglang.__version__
    assert drift.check() == []


def test_the_hooked_signature_matches():
    func, why = plugin.resolve_target()
    assert func is not None, why
    assert plugin.check_signature(func) == (True, "")


def test_the_write_location_is_built_as_this_releases_forward_extend_builds_it():
    """save_kv writes the drafts' KV with SGLang's own _set_kv_buffer; the location it passes
    must be the one forward_extend itself passes (KVWriteLoc.for_batch in 0.5.23, the plain
    KVWriteLoc(loc, swa_loc, full_loc=...) in 0.5.17)."""
    src = inspect.getsource(TritonAttnBackend.forward_extend)
    if hasattr(KVWriteLoc, "for_batch"):
        assert "KVWriteLoc.for_batch(" in src
    else:
        assert "KVWriteLoc(" in src and "out_cache_loc_full_physical" in src
    call = fallback.VerifyCall(backend=_Backend(_Meta()), q=torch.zeros(1), k=None, v=None, layer=None,
                               forward_batch=_Batch(out_cache_loc=torch.tensor([3, 4])))
    loc = plugin.write_loc(call)
    assert isinstance(loc, KVWriteLoc)
    assert torch.equal(loc.loc, torch.tensor([3, 4])) and loc.swa_loc is None


def test_each_optional_name_is_absent_only_where_its_path_is():
    """A name of fallback.OPTIONAL that this release lacks must mean its path is absent here:
    TritonAttnBackend's source then mentions it nowhere."""
    src = inspect.getsource(inspect.getmodule(TritonAttnBackend))
    for (module, clsname), names in fallback.OPTIONAL.items():
        have = drift.known_names(getattr(__import__(module, fromlist=[clsname]), clsname))
        for name in names:
            if name not in have:
                assert name not in src, f"{clsname}.{name} is absent but the backend reads it"


class _Batch:
    def __init__(self, out_cache_loc):
        self.out_cache_loc = out_cache_loc
        self.out_cache_loc_is_physical = True  # 0.5.23's for_batch reads it


class _Meta:
    swa_out_cache_loc = None
    out_cache_loc_full_physical = None


class _Backend:
    def __init__(self, meta):
        self.forward_metadata = meta
