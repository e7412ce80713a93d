"""The step plan: one verify step's batch schedule, made by its first call, read by the others."""

from __future__ import annotations

import torch

from kdtree_engine.kernel import library
from kdtree_engine.kernel.errors import argument_error


class VerifyPlan:
    """A step plan: the batch schedule of one verify step, made by the step's first call
    (``verify_attention(..., plan=plan, make_plan=True)``: a small kernel before that call's
    own) and read by the step's other calls (``plan=plan``: the model's other layers, with
    the same batch and the same lengths), as FlashMLA's calls read what its
    ``get_mla_metadata`` made once per step. Each main-kernel CTA then reads its job with one
    load instead of deriving it from every request's lengths (csrc/plan.cu).

    The buffer (``buffer``, the library's kdtree_plan_bytes) lives on ``device``; the host
    keeps the shape of the call that made it (``key``), and a call of another shape is refused
    before anything launches. The lengths stay on the device: a call whose lengths differ from
    the making call's sets the kernel's plan error bit (raised under ``KDTREE_DEBUG=1``) and
    leaves the rows the plan does not cover unwritten, so make the plan again whenever the
    batch's lengths change (each step). Calls that do not use the batch schedule (one request,
    or a batch that fills the GPU) neither make nor read it. Under CUDA-graph capture the
    making call's plan kernel is captured with it, so each replay plans from the lengths it
    replays."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        # an int is a CUDA ordinal; a device without an index is the current one
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if dev.type != "cuda":
            raise argument_error("device", "a CUDA device for the plan", str(dev))
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        lib = library.load()
        if not lib.has_plan:
            raise library.KernelLibraryError(f"kernel library {lib.path} (ABI {lib.abi}) takes no step plan; rebuild it")
        self.device = dev
        self.buffer = torch.zeros(lib.plan_bytes, dtype=torch.uint8, device=dev)
        #: (target, bs, num_heads, max_n, total_tokens, num_splits) of the call that made it; None until then
        self.key: tuple[int, int, int, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"VerifyPlan(device={self.device}, made_for={describe_plan_key(self.key)})"


def describe_plan_key(key: tuple[int, ...] | None) -> str:
    if key is None:
        return "nothing (never made)"
    target, bs, h, n, t = key[:5]
    splits = f" num_splits={key[5]}" if len(key) > 5 else ""
    return f"bs={bs} num_heads={h} max_n={n} total_tokens={t}{splits} target={target}"
