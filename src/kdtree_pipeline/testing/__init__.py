"""Test-only helpers, shipped so that the gates' worker processes and the GPU host's
sessions can use them: nothing in the plugin, the op or the kernel binding imports
this package.

- :mod:`~kdtree_pipeline.testing.standins`: import-time stand-ins for ``sgl_kernel`` and
  ``torchvision`` (they edit ``sys.modules``), for SGLang imports on machines without them.
- :mod:`~kdtree_pipeline.testing.fake_server`: a fake SGLang HTTP server for the smoke
  client's tests.
"""
