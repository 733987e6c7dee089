"""The suite's cheap learning checks, one per kind of demo: a short full fine-tune of the tiny flavor, in this
process (tests/trainer.py) on the session's cached upstreams, makes the model do what the demo's learning check
measures clearly better than the untrained model does. Text to image (the `tiny` family): the prompted color in the
decoded render (validate's color_accuracy); edit (`flux_kontext`): the result's latent nearest the instructed
color's mean target latent (validate's edit_color_accuracy). Each fails when training does not happen (with STEPS
set to 0 both score the untrained figure: margin 0).

Whole-demo runs of every variant the docs quote (adapters, optimizers, each edit family) are bench/learning.py's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer import steps, trainer_for
from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.families import resolve as models
from tuneline.stages.render.renderer import Renderer
from tuneline.stages.scan.demo import write_demo_for
from tuneline.stages.text import effective_max_length
from tuneline.stages.validate.colors import color_accuracy
from tuneline.stages.validate.edits import instructed_accuracy
from tuneline.stages.validate.learning import render_check, square_class_means

pytestmark = pytest.mark.slow

# Steps and learning rate of the short run, and the margin it must clear over the untrained model.
STEPS = {"tiny": 200, "flux_kontext": 200}
RATE = 3e-3
MARGIN = 0.3


def _config(workdir, family: str):
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    if family != "tiny":
        data["dataset"] = {"path": "demo-data", "demo": "edit"}
        data["model"] = {"family": family, "path": None, "device": "cpu"}
    data["train"] |= {"steps": STEPS[family], "processes": 1, "learning_rate": RATE, "validate_every": 0}
    data["validate"] |= {"check_seeds": 4}
    return parse_config(data)


def _accuracy(ctx, renderer: Renderer, upstream: dict) -> float:
    cfg = ctx.cfg
    width, height, means = square_class_means(ctx, upstream, "learning check")
    if cfg.dataset.demo == "edit":
        return instructed_accuracy(renderer, cfg, (width, height), means)
    colors, latents = render_check(renderer, cfg, (width, height))
    return color_accuracy(renderer.decode(latents), colors)


@pytest.mark.parametrize("family", list(STEPS))
def test_a_short_run_learns_what_the_demo_checks(family, upstream_store, tmp_path):
    cfg = _config(tmp_path / "w", family)
    write_demo_for(cfg)
    ctx = upstream_store.upstream(cfg)
    upstream = {"latents": ctx.store.read(ctx.store.latest("latents"), LatentsManifest)}
    trainer = trainer_for(cfg, ctx)
    fam, model_dir, cpu = models.family(cfg), models.model_dir(ctx), torch.device("cpu")
    length = effective_max_length(cfg)
    untrained = _accuracy(ctx, Renderer.load(fam, model_dir, cpu, torch.float32, max_length=length), upstream)
    steps(trainer, STEPS[family])
    renderer = Renderer.load(fam, model_dir, cpu, torch.float32, denoiser=trainer.denoiser, max_length=length)
    trained = _accuracy(ctx, renderer, upstream)
    assert trained - untrained >= MARGIN, (trained, untrained)
