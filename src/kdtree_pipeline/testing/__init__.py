"""Test-only helpers, for the gates' worker processes and the runs on the GPU host:
nothing in the product (the plugin, the op, the kernel binding) imports this
package.

- :mod:`~kdtree_pipeline.testing.standins`: import-time stand-ins for ``sgl_kernel`` and
  ``torchvision`` (they edit ``sys.modules``), for SGLang imports on machines without them.
- :mod:`~kdtree_pipeline.testing.fake_server`: a fake SGLang HTTP server for the smoke
  client's tests.
"""
