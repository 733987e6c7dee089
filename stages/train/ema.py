"""The exponential moving average of the trained weights (train.ema): what final/ holds when it is on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


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
