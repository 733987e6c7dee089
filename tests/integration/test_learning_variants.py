"""The suite's cheap learning check of the edit demo: a short full fine-tune of the flux_kontext tiny flavor, in this
process (tests/trainer.py) on the session's cached upstreams of the edit demo, makes the model follow "make it
<color>" clearly better than the untrained model: the result's latent nearest the instructed color's mean target
latent (validate's edit_color_accuracy). Measured: 200 steps pass; with no step taken the test fails (0.125 trained,
0.125 untrained).

The text-to-image demo's check reads the README quick start's run, which the suite runs once anyway
(tests/integration/test_train_demo.py: color_accuracy >= 0.9 trained, <= 0.5 untrained). Whole-demo runs of every
variant the docs quote (adapters, optimizers, each edit family) are bench/learning.py's.
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
from tuneline.stages.validate.edits import instructed_accuracy
from tuneline.stages.validate.learning import square_class_means

pytestmark = pytest.mark.slow

# The short run (one process, the example's batch of 8) and the margin it must clear over the untrained model.
STEPS, RATE, MARGIN = 200, 3e-3, 0.3


def _config(workdir):
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["dataset"] = {"path": "demo-data", "demo": "edit"}
    data["model"] = {"family": "flux_kontext", "path": None, "device": "cpu"}
    data["train"] |= {"steps": STEPS, "processes": 1, "learning_rate": RATE, "validate_every": 0}
    data["validate"] |= {"check_seeds": 4}
    return parse_config(data)


def test_a_short_run_follows_the_instruction(upstream_store, tmp_path):
    cfg = _config(tmp_path / "w")
    write_demo_for(cfg)
    ctx = upstream_store.upstream(cfg)
    upstream = {"latents": ctx.store.read(ctx.store.latest("latents"), LatentsManifest)}
    width, height, means = square_class_means(ctx, upstream, "edit learning check")
    fam, model_dir, cpu, length = (
        models.family(cfg),
        models.model_dir(ctx),
        torch.device("cpu"),
        effective_max_length(cfg),
    )

    def accuracy(**trained) -> float:
        renderer = Renderer.load(fam, model_dir, cpu, torch.float32, max_length=length, **trained)
        return instructed_accuracy(renderer, cfg, (width, height), means)

    untrained = accuracy()
    trainer = trainer_for(cfg, ctx)
    steps(trainer, STEPS)
    trained = accuracy(denoiser=trainer.denoiser)
    assert trained - untrained >= MARGIN, (trained, untrained)
