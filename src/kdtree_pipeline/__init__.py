"""kdtree_pipeline: the proof of kdtree-engine, run from the checkout (never installed).

One module or package per gate, named after it: ``build``, ``oracle`` (fp32 reference,
workloads, tolerances, the self-test), ``bench`` (peers, roofline, targets, reports),
``integrate`` (SGLang's real backend, plugin on vs off), ``smoke`` (a live server),
``graph`` (CUDA-graph capture and replay), ``defrag``. The record keeping: ``phases`` (the
phase -> gates table), ``evidence`` (one JSON record per gate run), ``plan`` (state and
render), ``commit`` (GitPython), ``run`` (a phase end to end). ``testing`` holds stand-ins
the gates' worker processes and the tests use.

Data flows one way: gate -> evidence record -> plan state -> template -> commit. Every
arrow points down: this package imports ``kdtree_engine``, never the other way.
"""
