"""Drift check: does this SGLang still have every attribute and method the plugin reads?

Run once when the hook would be registered. For each (module, class) of
:data:`kdtree_engine.sglang.fallback.REQUIRED` (and, for a release outside
:data:`~kdtree_engine.sglang.fallback.SUPPORTED`, of ``OPTIONAL`` too), and for one of the
spellings of each :data:`~kdtree_engine.sglang.fallback.ONE_OF`, a name counts as present when it
is an attribute of the class or a base (methods, class attributes, dataclass
fields, annotations) or an attribute that some method of the class or a base
assigns (``self.name = ...``, read from the bytecode: instance attributes exist
only on instances, and the check must not build one). ``_set_kv_buffer``'s
parameters are checked too, since ``save_kv`` calls it positionally.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from kdtree_engine.sglang.fallback import ONE_OF, OPTIONAL, REQUIRED, in_supported_range

#: ``TritonAttnBackend._set_kv_buffer``'s leading parameters as ``save_kv`` calls it.
SET_KV_PARAMS = ("self", "forward_batch", "layer", "loc_info", "k", "v")


def _assigned(func: Any) -> set[str]:
    func = getattr(func, "__func__", func)  # classmethod / staticmethod
    func = getattr(func, "fget", func)  # property
    code = getattr(func, "__code__", None)
    if code is None:
        return set()
    return {ins.argval for ins in dis.get_instructions(code) if ins.opname == "STORE_ATTR"}


def known_names(cls: type) -> set[str]:
    """Every attribute name ``cls`` or a base declares or assigns in a method."""
    names: set[str] = set(dir(cls))
    for k in cls.__mro__:
        if k is object:
            continue
        names |= set(vars(k)) | set(getattr(k, "__annotations__", {}))
        if dataclasses.is_dataclass(k):
            names |= {f.name for f in dataclasses.fields(k)}
        for v in vars(k).values():
            names |= _assigned(v)
    return names


def _class(module: str, clsname: str) -> tuple[type | None, str]:
    try:
        return getattr(importlib.import_module(module), clsname), ""
    except Exception as e:  # noqa: BLE001 - a missing module or class is drift too
        return None, f"{module}.{clsname} ({type(e).__name__}: {e})"


def required_for(version: str | None) -> dict[tuple[str, str], tuple[str, ...]]:
    """The names a release must have: REQUIRED, and OPTIONAL's too outside the supported range
    (where nobody has read what their absence means)."""
    if in_supported_range(version):
        return dict(REQUIRED)
    out = {k: tuple(v) for k, v in REQUIRED.items()}
    for key, names in OPTIONAL.items():
        out[key] = out.get(key, ()) + tuple(names)
    return out


def sglang_version() -> str | None:
    try:
        import sglang

        return getattr(sglang, "__version__", None)
    except Exception:  # noqa: BLE001 - no SGLang: everything is missing, reported per class
        return None


def check(required: Mapping[tuple[str, str], tuple[str, ...]] | None = None,
          one_of: Mapping[tuple[str, str], tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]] = ONE_OF,
          ) -> list[str]:
    """What is missing, as ``module.Class.name`` (empty: nothing). ``required`` defaults to
    :func:`required_for` this SGLang's version; for each ``one_of`` entry one spelling (the names
    it has, the names it must not have) must fit, else the first one's missing names are reported."""
    if required is None:
        required = required_for(sglang_version())
    missing: list[str] = []
    for (module, clsname), spellings in one_of.items():
        cls, err = _class(module, clsname)
        if cls is None:
            missing.append(err)
            continue
        have = known_names(cls)
        if not any(all(n in have for n in names) and not any(n in have for n in absent)
                   for names, absent in spellings):
            missing += [f"{module}.{clsname}.{n}" for n in spellings[0][0] if n not in have]
    for (module, clsname), names in required.items():
        cls, err = _class(module, clsname)
        if cls is None:
            missing.append(err)
            continue
        have = known_names(cls)
        missing += [f"{module}.{clsname}.{n}" for n in names if n not in have]
        if clsname == "TritonAttnBackend" and "_set_kv_buffer" in have:
            try:
                params = tuple(inspect.signature(cls._set_kv_buffer).parameters)[: len(SET_KV_PARAMS)]
            except (TypeError, ValueError):
                params = ()
            if params != SET_KV_PARAMS:
                missing.append(f"{module}.{clsname}._set_kv_buffer parameters {SET_KV_PARAMS} (found {params})")
    return missing
