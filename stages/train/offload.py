"""train.gradient_checkpointing: offload. Checkpointing keeps only each block's inputs for the backward, which
recomputes the rest; offloading keeps those inputs in (pinned) CPU memory instead of on the device.

Passed to diffusers as the model's checkpointing function: the block's tensor arguments go to the CPU, and the
checkpointed function (run in forward and again in backward) brings them back first. Gradients flow through both
copies, so the numbers are those of plain checkpointing. On a CPU device the copies are no-ops.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _to_cpu(x):
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
        return x
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    return out.copy_(x, non_blocking=True)  # differentiable: the gradient goes back to the device tensor


def offloaded_checkpoint(function, *args, **kwargs):
    device = next((a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)), None)

    def back(x):
        return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) and device is not None else x

    def run(*a, **k):
        return function(*[back(x) for x in a], **{n: back(v) for n, v in k.items()})

    return checkpoint(
        run, *[_to_cpu(a) for a in args], use_reentrant=False, **{n: _to_cpu(v) for n, v in kwargs.items()}
    )
