"""The ``bench`` gate: the owned verify kernel against SGLang's paths and FlashMLA.

- :mod:`.suites`: the cases of each suite (micro, long-context, fragmentation, graph)
- :mod:`.data`: rotated random input sets of a case, generated on the GPU
- :mod:`.peers`: one adapter per timed system (ours, SGLang extend, SGLang split-KV, FlashMLA)
- :mod:`.timing`: CUDA-graph replay and eager timing of one system, with the reference check
- :mod:`.roofline`: measured copy bandwidth / matmul rate, and each case's floor
- :mod:`.targets`: the issue-4 targets evaluated on one run's figures
- :mod:`.report`: JSON, markdown tables, PNG plots
- :mod:`.gate`: ``python -m kdtree_pipeline bench --suite ...``
"""
