"""Drift check: does this SGLang still have every attribute and method the plugin reads?

Run once when the hook would be registered. For each (module, class) of
:data:`kdtree_engine.sglang.fallback.REQUIRED`, a name counts as present when it
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

from kdtree_engine.sglang.fallback import REQUIRED

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


def check(required: Mapping[tuple[str, str], tuple[str, ...]] = REQUIRED) -> list[str]:
    """What is missing, as ``module.Class.name`` (empty: nothing)."""
    missing: list[str] = []
    for (module, clsname), names in required.items():
        try:
            cls = getattr(importlib.import_module(module), clsname)
        except Exception as e:  # noqa: BLE001 - a missing module or class is drift too
            missing.append(f"{module}.{clsname} ({type(e).__name__}: {e})")
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
