"""kdtree-engine: a tree-verify MLA attention kernel for speculative decoding,
its SGLang plugin, and the phased pipeline that proves each step.

Packages (data flows one way: gate -> evidence -> plan state -> template -> commit):

- ``kernel``   build (nvcc -> shared library), library (ctypes C ABI), op (checks + torch op)
- ``oracle``   fp32 reference, workloads (trees, SGLang layouts), tolerances, the oracle gate
- ``bench``    peers, roofline, reports, the bench gate
- ``sglang``   the SGLang plugin, its fallback predicates, the integrate gate
- ``smoke``    live-service smoke client and gate
- ``graph``    CUDA-graph capture/replay gate
- ``defrag``   KV-cache compaction and its gate
- ``pipeline`` phases, evidence records, plan state/render, git commit
"""

__version__ = "0.1.0"
