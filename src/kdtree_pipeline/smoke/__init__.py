"""The smoke gate: a live SGLang server serving through the plugin (:mod:`.gate`).

- :mod:`.model`: the checkpoint it serves (one TP8 rank of Kimi K2.6 per layer, generated weights)
- :mod:`.live`: one launch per server start, its requests, its checks, its cleanup
- :mod:`.compare`: greedy outputs of kernel on against off, and the bf16 tolerance
- :mod:`.client`: HTTP (httpx, streaming included) and readiness
- :mod:`.launcher`: a server in its own process group, stopped whole
- ``standins/``: import-only stand-ins the server's path gets for packages SGLang 0.5.17
  imports at start on paths the gate never takes (xgrammar, DeepGEMM)
"""
