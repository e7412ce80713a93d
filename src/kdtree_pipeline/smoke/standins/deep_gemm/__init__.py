"""Import-only stand-in for sgl-deep-gemm: SGLang 0.5.17 imports its sparse-attention backend, which
imports deep_gemm, when it captures CUDA graphs; the live smoke never runs that backend. Use with
SGLANG_ENABLE_JIT_DEEPGEMM=0:
configurer.py:27-33 then keeps ENABLE_JIT_DEEPGEMM False, so nothing imports deep_gemm.utils."""
__version__ = "0.0.0+stub"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"deep_gemm stub has no {name!r} (set SGLANG_ENABLE_JIT_DEEPGEMM=0)")
