"""The in-process trainer: the real `Trainer` over a workdir's published caches, opened as a training worker opens
them (`read_data` of stages/train/worker.py), in this process: no torchrun, no three interpreters importing torch.

For tests about a training behaviour (optimizer maths, EMA, schedules, samplers, adapters' numerics, masks) and
for bench/gpu.py. Tests about the launch, the stage's published outputs or distribution run the train stage.

    ctx = upstream_store.upstream(cfg)  # the run's built caches (fixture upstream_store, tests/conftest.py)
    trainer = trainer_for(cfg, ctx)
    steps(trainer, 2)                    # trainer.losses, trainer.params, trainer.checkpoint() ...
"""

from __future__ import annotations

from contextlib import closing

import torch

from tuneline.stages.common.stage import StageContext
from tuneline.stages.families import resolve as models
from tuneline.stages.pipeline import stages_for
from tuneline.stages.train.loop import Trainer
from tuneline.stages.train.plan import micro_batches
from tuneline.stages.train.worker import read_data

CACHES = ("caption", "latents", "text")  # the upstream versions a worker is handed (caption when the stage is on)


def trainer_for(cfg, ctx: StageContext, rank: int = 0, world: int = 1) -> Trainer:
    """A Trainer for `cfg` over the newest caches published in `ctx`'s workdir, as rank `rank` of `world`."""
    device = torch.device(cfg.model.device if cfg.model.device != "auto" else "cuda")
    up = {sd.name: ctx.store.latest(sd.name) for sd in stages_for(cfg) if sd.name in CACHES}
    fam, model_dir = models.family(cfg), models.model_dir(ctx)
    return Trainer(cfg, fam, model_dir, read_data(cfg, up, fam, model_dir, device), rank, world, device)


def feed(trainer: Trainer):
    """The trainer's micro-batches from where it stands, planned as the worker plans them."""
    t = trainer.t
    plans = trainer.data.rows.epoch_plans(trainer.world)
    return closing(trainer.feed(micro_batches(plans, t.batch_size, trainer.rank, trainer.position)))


def steps(trainer: Trainer, n: int) -> None:
    """`n` optimizer steps of the real loop (train.grad_accumulation micro-batches each)."""
    with feed(trainer) as fed:
        for _ in range(n):
            trainer.train_step([next(fed) for _ in range(trainer.t.grad_accumulation)])
