"""Held-out eval loss (train.eval): a stable split that never trains, and a reproducible number."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_train_support import small_config, train
from tests.tracing import tuneline_trace
from tests.trainer import steps, trainer_for
from tuneline.schemas.sources import dataset_sources
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.train import checkpoint as ckpt
from tuneline.stages.train.evaluation import Evaluator
from tuneline.stages.train.rows import RowPlan, held_out

EVAL = {"fraction": 0.3, "every_steps": 1, "timesteps": [100, 600]}


def test_eval_loss_is_the_same_for_the_same_weights_and_changes_with_training(tmp_path, upstream_store, demo_data):
    cfg = small_config(
        tmp_path, {"steps": 2, "processes": 1, "batch_size": 2, "eval": EVAL}, dataset={"path": str(demo_data)}
    )
    ctx = upstream_store.upstream(cfg)
    trainer = trainer_for(cfg, ctx)
    held = RowPlan(trainer.data.reader, cfg.train, dataset_sources(cfg)).held_rows()
    evaluator = Evaluator(trainer, held, EVAL["timesteps"])
    first, again = evaluator.evaluate(), evaluator.evaluate()
    assert first == again and set(first["per_timestep"]) == {"100", "600"}
    steps(trainer, 1)
    assert evaluator.evaluate()["loss"] != first["loss"]


@pytest.mark.ddp(reason="ranks split the held-out rows and all-reduce the sums; no rank trains a held-out image")
def test_held_out_images_never_train_and_two_ranks_log_the_one_process_eval(
    tmp_path, monkeypatch, upstream_store, demo_data
):
    """2 gloo processes each evaluate their share of the held-out rows in batches and all-reduce the sums: the
    manifest's eval losses are the ones one process computes, row by row, for the same weights."""
    train_keys = {"steps": 3, "processes": 2, "batch_size": 2, "eval": EVAL, "ema": False}
    cfg = small_config(tmp_path, train_keys, dataset={"path": str(demo_data)})
    ctx = upstream_store.upstream(cfg)
    tuneline_trace.enable(monkeypatch, tmp_path)
    out = train(cfg)
    trained = {p for rank in (0, 1) for row in read_jsonl(tmp_path / f"trace-rank{rank}.jsonl") for p in row["paths"]}
    assert trained and not any(held_out(p, EVAL["fraction"]) for p in trained)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["step"] for e in manifest["eval_losses"]] == [1, 2, 3]
    assert all(set(e["per_timestep"]) == {"100", "600"} and e["loss"] > 0 for e in manifest["eval_losses"])

    trainer = trainer_for(cfg, ctx)
    state, tensors = ckpt.load(out / "checkpoints" / "step-0000003")  # the weights the last eval saw
    with torch.no_grad():
        for name, p in trainer.params.items():
            p.copy_(tensors["trainable"][name])
    trainer.step = state["step"]
    held = RowPlan(trainer.data.reader, cfg.train, dataset_sources(cfg)).held_rows()
    assert sum(len(rows) for rows in held.values()) > 2, "too few held-out rows to split over two ranks"
    alone = Evaluator(trainer, held, EVAL["timesteps"]).evaluate()  # one process, batch 1
    logged = manifest["eval_losses"][-1]
    assert alone["step"] == logged["step"] == 3
    assert alone["loss"] == pytest.approx(logged["loss"], rel=1e-4, abs=1e-6)
    for t in ("100", "600"):
        assert alone["per_timestep"][t] == pytest.approx(logged["per_timestep"][t], rel=1e-4, abs=1e-6)
