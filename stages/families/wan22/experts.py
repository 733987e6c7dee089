"""The denoiser a Wan 2.2 A14B run trains: the timestep experts it holds, by pipeline component, each sample routed
to the expert WanPipeline would denoise it with.

WanPipeline (diffusers' pipeline_wan.py) runs `transformer` (high noise) at timesteps
t >= boundary_ratio * num_train_timesteps and `transformer_2` (low noise) below; training routes the same way, so
each expert learns only the share of the schedule it denoises. A run of both draws each optimizer step's timesteps
on one side of the boundary, the same side on every rank (Family.sigma_splits, SigmaSampler.step_share): a step
then runs one expert's blocks on every rank, which FSDP's collectives and block swap's schedule need. A run of one
expert holds only that one (half the weights) and draws its timesteps from its share (Family.sigma_range).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

HIGH, LOW = "transformer", "transformer_2"


class Experts(torch.nn.Module):
    """`experts`: component -> WanTransformer3DModel (one or both); `boundary`: boundary_ratio as a sigma, or None
    (a folder with one transformer: it denoises every timestep)."""

    _supports_gradient_checkpointing = True

    def __init__(self, experts: dict[str, torch.nn.Module], boundary: float | None):
        super().__init__()
        self.experts = torch.nn.ModuleDict(experts)
        self.boundary = boundary

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.experts.values())).dtype

    @property
    def config(self) -> Any:
        return next(iter(self.experts.values())).config

    def sigma_range(self) -> tuple[float, float]:
        """The noise levels this run trains: every one with both experts (or without a boundary), else the held
        expert's share."""
        if self.boundary is None or len(self.experts) > 1:
            return 0.0, 1.0
        return (self.boundary, 1.0) if HIGH in self.experts else (0.0, self.boundary)

    def add_adapter(self, config: Any) -> None:
        for expert in self.experts.values():
            expert.add_adapter(copy.deepcopy(config))

    def enable_gradient_checkpointing(self, gradient_checkpointing_func: Any = None) -> None:
        for expert in self.experts.values():
            expert.enable_gradient_checkpointing(gradient_checkpointing_func)

    def routes(self, timestep: torch.Tensor) -> list[tuple[torch.nn.Module, torch.Tensor]]:
        """(expert, indices of its samples) for each expert with samples: WanPipeline's rule, t >= boundary * 1000
        to the high-noise expert."""
        if len(self.experts) == 1:
            return [(next(iter(self.experts.values())), torch.arange(len(timestep), device=timestep.device))]
        high = timestep >= self.boundary * 1000.0
        picks = [(self.experts[HIGH], high.nonzero().flatten()), (self.experts[LOW], (~high).nonzero().flatten())]
        return [(expert, idx) for expert, idx in picks if len(idx)]

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor]:
        """WanTransformer3DModel's call (return_dict=False), each sample through its expert."""
        routes = self.routes(timestep)
        if len(routes) == 1:
            return (routes[0][0](hidden_states, timestep, encoder_hidden_states, return_dict=False)[0],)
        out = torch.empty_like(hidden_states)
        for expert, idx in routes:
            part = expert(hidden_states[idx], timestep[idx], encoder_hidden_states[idx], return_dict=False)[0]
            out = out.index_put((idx,), part.to(out.dtype))
        return (out,)
