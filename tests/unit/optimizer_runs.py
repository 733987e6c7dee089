"""Optimizer runs the optimizer tests share: seeded weights and gradients, steps, and a run cut at a checkpoint."""

from __future__ import annotations

import torch

from tuneline.schemas.train import TrainConfig
from tuneline.stages.train.optimizers import build_optimizer


def init_and_grads(steps=4):
    torch.manual_seed(0)
    init = {"w": torch.randn(16, 24), "conv": torch.randn(8, 4, 3, 3), "b": torch.randn(24)}
    return init, [{k: torch.randn_like(v) for k, v in init.items()} for _ in range(steps)]


def run_steps(params, opt, grads):
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


def fresh(init):
    return {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}


def straight_and_cut(init: dict, grads: list, t: TrainConfig, cut: int = 2):
    """The weights after every step in one run, and a second run stopped after `cut` steps with its optimizer
    (to checkpoint and resume, or to look at mid-run)."""
    straight = fresh(init)
    run_steps(straight, build_optimizer(list(straight.values()), t), grads)
    first = fresh(init)
    opt = build_optimizer(list(first.values()), t)
    run_steps(first, opt, grads[:cut])
    return straight, first, opt
