"""kdtree-engine: a tree-verify MLA attention kernel for speculative decoding and its SGLang plugin.

- ``kernel``  the library's C ABI through ctypes (``library``), the checked torch op
              (``op.verify_attention``), and the nvcc build of ``csrc/`` (``build``)
- ``sglang``  the plugin SGLang loads in every worker (``plugin``), the predicates that send
              a call to the kernel or to SGLang's own path (``fallback``), and the check that
              SGLang still has what the hooked path reads (``drift``)
- ``defrag``  compaction of SGLang's page-size-1 KV pool into contiguous runs

Nothing here imports the proof: the gates, evidence and plan live in ``kdtree_pipeline``,
which runs from the checkout and is not part of the wheel.
"""

__version__ = "0.1.0"
