"""The verify op's refusal of a bad argument: one exception, one sentence shape.

Every check of :func:`kdtree_engine.kernel.op.verify_attention`'s arguments (the target in
:mod:`~kdtree_engine.kernel.library`, the tensors and scalars in
:mod:`~kdtree_engine.kernel.args`, the step plan in :mod:`~kdtree_engine.kernel.op`) raises
the same :class:`VerifyArgumentError`, built by :func:`argument_error`, so that a caller
(the SGLang plugin falls back on it) catches one type and a reader sees one form:
``verify_attention: argument 'q': expected dtype torch.bfloat16, got torch.float32``.
"""

from __future__ import annotations

__all__ = ["VerifyArgumentError", "argument_error"]


class VerifyArgumentError(ValueError):
    """An argument of :func:`verify_attention` is wrong; the message names it."""


def argument_error(arg: str, expected: str, got: object) -> VerifyArgumentError:
    """The error for argument ``arg``: what was ``expected`` and what came (``got``)."""
    return VerifyArgumentError(f"verify_attention: argument '{arg}': expected {expected}, got {got}")
