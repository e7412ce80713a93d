"""Import-only stand-in for xgrammar, which SGLang 0.5.17 imports at server start (server_args ->
function_call parsers) whatever --grammar-backend says; the live smoke runs --grammar-backend none,
so nothing calls it. Any real use raises.
StructuralTag is a pydantic model because sglang's OpenAI protocol models use it as a field type
(srt/entrypoints/openai/protocol.py:57-60)."""
import pydantic

__version__ = "0.0.0+stub"


class _Stub(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")


class StructuralTag(_Stub):
    @classmethod
    def from_legacy_structural_tag(cls, *a, **k):
        raise RuntimeError("xgrammar stub: structural tags need the real xgrammar")


def get_model_structural_tag(*a, **k):
    raise RuntimeError("xgrammar stub")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"xgrammar stub has no {name!r}")
