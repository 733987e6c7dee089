"""The measured time per step: the early pace line after the warm-up, the figure the manifest records, and what
`tuneline plan CONFIG` says of it (the newest train version of the same train and model config, steps aside)."""

from __future__ import annotations

import json

from tests.integration.test_train_support import small_config
from tuneline.stages.train import STAGE
from tuneline.stages.train.pace import PaceMeter, measured_line


def test_the_pace_leaves_out_the_warm_up_and_speaks_once():
    meter = PaceMeter(first_step=0, steps=200)
    assert meter.step_seconds() is None
    meter.times = [12.0, 7.5]
    assert meter.step_seconds() == 7.5 and meter.early_line(2) is None  # one step past the warm-up: too few
    meter.times = [12.0, 7.5, 7.6]
    assert meter.early_line(3) == (
        "pace: 7.55 s/step measured over steps 2-3 (step 1, with the warm-up, took 12 s): the 197 steps left take "
        "about 24m47s, checkpoints and renders besides"
    )
    meter.times.append(9.0)
    assert meter.early_line(4) is None and meter.step_seconds() == 7.6  # the median
    resumed = PaceMeter(first_step=100, steps=104)
    resumed.times = [3.0, 1.0, 1.0]
    assert "over steps 102-103" in resumed.early_line(103) and "the 1 steps left" in resumed.early_line(103)


def publish(workdir, name, config, seconds, created):
    folder = workdir / "artifacts" / "train" / name
    folder.mkdir(parents=True)
    manifest = {
        "config": config,
        "step_seconds": seconds,
        "world_size": 1,
        "global_batch": 4,
        "created_at": created,
        "upstream": {"latents": "0123456789abcdef"},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")


def test_plan_shows_the_newest_measured_step_of_the_same_config(tmp_path):
    cfg = small_config(tmp_path, {"steps": 200})
    assert measured_line(cfg, STAGE.config(cfg)).startswith("time per step: not measured yet for this config")
    before = small_config(tmp_path, {"steps": 50})  # another step count trains the same steps
    other = small_config(tmp_path, {"batch_size": 1})  # another batch does not
    publish(cfg.workdir_path(), "v-old", STAGE.config(before), 9.0, "2026-01-01T00:00:00")
    publish(cfg.workdir_path(), "v-new", STAGE.config(before), 7.5, "2026-01-02T00:00:00")
    publish(cfg.workdir_path(), "v-other", STAGE.config(other), 1.0, "2026-01-03T00:00:00")
    publish(cfg.workdir_path(), ".partial", STAGE.config(before), 1.0, "2026-01-04T00:00:00")  # not published
    assert measured_line(cfg, STAGE.config(cfg)) == (
        "time per step: 7.5 s, measured by train version v-new (1 process(es), global batch 4, on the latents "
        "version 0123456789ab): 200 steps take about 25m00s"
    )
