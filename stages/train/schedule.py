"""Learning-rate schedules and the EMA of trained weights.

The learning rate is a pure function of the step, so a resumed run needs only the step to continue the schedule
exactly (the checkpoint records it with the rate it used).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def lr_at(step: int, base_lr: float, schedule: str, warmup: int, total: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total`: linear warmup over `warmup` steps, then
    constant, linear decay to 0 or cosine decay to 0 at the last step."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return base_lr
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup + 1) / span)
    if schedule == "linear":
        return base_lr * (1.0 - progress)
    if schedule == "cosine":
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.lr_schedule: unknown schedule {schedule!r}; use constant, linear or cosine")


class EMA:
    """Exponential moving average of named float tensors, with diffusers' warmup of the decay (early averages
    would otherwise be dominated by the random or base initialisation)."""

    def __init__(self, params: dict[str, torch.Tensor], decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in params.items()}

    def decay_at(self, step: int) -> float:
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, params: dict[str, torch.Tensor], step: int) -> None:
        d = self.decay_at(step)
        for k, p in params.items():
            self.shadow[k].lerp_(p.detach().float(), 1.0 - d)

    @torch.no_grad()
    def copy_to(self, params: dict[str, torch.Tensor]) -> None:
        for k, p in params.items():
            p.copy_(self.shadow[k].to(p.dtype))

    @contextmanager
    def applied(self, params: dict[str, torch.Tensor]) -> Iterator[None]:
        """The EMA weights in the model for the duration (validation renders), the live ones restored after."""
        saved = {k: p.detach().clone() for k, p in params.items()}
        self.copy_to(params)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(saved[k])
