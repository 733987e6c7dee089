"""Held-out eval loss (train.eval): a stable split that never trains, and a reproducible number."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_train_support import build_upstream, small_config, train
from tests.tracing import tuneline_trace
from tests.trainer import steps, trainer_for
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.train.evaluation import Evaluator
from tuneline.stages.train.rows import RowPlan, held_out

EVAL = {"fraction": 0.3, "every_steps": 1, "timesteps": [100, 600]}


def test_eval_loss_is_the_same_for_the_same_weights_and_changes_with_training(tmp_path):
    cfg = small_config(tmp_path, {"steps": 2, "processes": 1, "batch_size": 2, "eval": EVAL})
    ctx = build_upstream(cfg)
    trainer = trainer_for(cfg, ctx)
    held = RowPlan(trainer.data.reader, cfg.train, dataset_sources(cfg)).held_rows()
    evaluator = Evaluator(trainer, held, EVAL["timesteps"])
    first, again = evaluator.evaluate(), evaluator.evaluate()
    assert first == again and set(first["per_timestep"]) == {"100", "600"}
    steps(trainer, 1)
    assert evaluator.evaluate()["loss"] != first["loss"]


@pytest.mark.ddp(reason="no rank trains a held-out image; rank 0 records the evaluations")
def test_held_out_images_never_train_and_the_manifest_records_each_evaluation(tmp_path, monkeypatch):
    cfg = small_config(tmp_path, {"steps": 3, "processes": 2, "batch_size": 2, "eval": EVAL})
    build_upstream(cfg)
    tuneline_trace.enable(monkeypatch, tmp_path)
    out = train(cfg)
    trained = {p for rank in (0, 1) for row in read_jsonl(tmp_path / f"trace-rank{rank}.jsonl") for p in row["paths"]}
    assert trained and not any(held_out(p, EVAL["fraction"]) for p in trained)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["step"] for e in manifest["eval_losses"]] == [1, 2, 3]
    assert all(set(e["per_timestep"]) == {"100", "600"} and e["loss"] > 0 for e in manifest["eval_losses"])
