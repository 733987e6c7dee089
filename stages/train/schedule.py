"""Learning-rate schedules (the EMA of trained weights is in ema.py).

The learning rate is a pure function of the step, so a resumed run needs only the step to continue the schedule
exactly (the checkpoint records it with the rate it used).
"""

from __future__ import annotations

import math


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
