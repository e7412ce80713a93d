"""SGLang integration: the plugin (entry point ``kdtree_verify``, hook on
``TritonAttnBackend.forward_extend``), its fallback predicates, and the
``integrate`` gate that drives SGLang's real Triton backend with the plugin off
and on. ``_standins`` holds import-time stand-ins used by test harnesses only."""
