"""An in-training validation that crashes does not lose the step it followed: the step's checkpoint is written
before rendering, so the rerun resumes from it; the error names the exception the worker died of."""

from __future__ import annotations

import pytest

from tests.integration.test_train_support import small_config, train
from tuneline.stages.common.stage import StageContext, expected_versions
from tuneline.stages.pipeline import PIPELINE
from tuneline.stages.train.failures import TrainingFailed


def test_a_crashing_validation_keeps_the_checkpoint_of_its_step(tmp_path, upstream_store, demo_data):
    train_keys = {"steps": 4, "processes": 1, "batch_size": 4, "checkpoint_every": 2, "validate_every": 2}
    cfg = small_config(tmp_path, train_keys, dataset={"path": str(demo_data)})
    upstream_store.upstream(cfg)
    key = expected_versions(StageContext(cfg), PIPELINE)["train"][0]
    work = tmp_path / "artifacts" / "train" / f".{key}.partial"
    work.mkdir(parents=True)
    (work / "samples").write_text("in the way: the validation grid's folder cannot be made", encoding="utf-8")
    with pytest.raises(TrainingFailed) as err:
        train(cfg)
    assert "FileExistsError" in str(err.value), str(err.value)
    assert (work / "checkpoints" / "step-0000002").is_dir(), (
        sorted(p.name for p in (work / "checkpoints").iterdir())
        if (work / "checkpoints").is_dir()
        else "no checkpoint at all"
    )
    (work / "samples").unlink()
    path = train(cfg)  # the rerun resumes from step 2 and finishes
    assert (path / "samples" / "step-0000004.png").is_file()
