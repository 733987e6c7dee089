"""Slow (a whole demo run each, ~2-3 minutes on 2 CPU cores): the demo's learning check still passes with one
setting changed: train.optimizer prodigy (learning rate 1.0, Prodigy's own value), and train.adapter lokr (a
LoKr needs train.mode lora; the demo's learning rate is for a full fine-tune, so the LoKr run states its own)."""

from __future__ import annotations

import copy
import json

import pytest

from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.pipeline import PIPELINE
from tuneline.stages.scan.demo import write_demo_dataset

VARIANTS = {
    "prodigy": {"optimizer": "prodigy", "learning_rate": 1.0},
    "lokr": {"mode": "lora", "adapter": "lokr", "lora_rank": 16, "learning_rate": 1e-2},
}


def demo_with(workdir, train: dict) -> dict:
    data = copy.deepcopy(DEMO_CONFIG)
    data["workdir"] = str(workdir)
    data["train"] = {**data["train"], **train}
    cfg = parse_config(data)
    write_demo_dataset(cfg.resolve(cfg.dataset.path))
    ctx = StageContext(cfg)
    paths = {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in PIPELINE}
    return json.loads((paths["validate"] / "manifest.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_demo_learning_check_passes_with(variant, tmp_path):
    m = demo_with(tmp_path, VARIANTS[variant])
    assert m["color_accuracy"] >= 0.9 and m["untrained_color_accuracy"] < m["color_accuracy"], m
