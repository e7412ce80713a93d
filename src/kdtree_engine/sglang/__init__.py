"""SGLang integration: the plugin (entry point ``kdtree_verify``, hook on
``TritonAttnBackend.forward_extend``), its fallback predicates, and the
``integrate`` gate that drives SGLang's real Triton backend with the plugin off
and on. Test-only stand-ins live in :mod:`kdtree_pipeline.testing`, which the plugin never imports."""
