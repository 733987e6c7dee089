"""A resume is exact or refused: an explicit train.resume checkpoint made with another optimizer, adapter, mode,
dtype or family than the config's is refused by the train stage's check before any training process starts,
naming the field, both values and the fix; a checkpoint without that record is refused with a clear message."""

from __future__ import annotations

import json

import pytest
import torch

from tuneline.schemas.config import parse_config
from tuneline.stages.common.stage import StageContext
from tuneline.stages.train import checkpoint as ckpt
from tuneline.stages.train.failures import TrainingFailed
from tuneline.stages.train.launch import resume_target

MADE = {"model": {"family": "tiny", "dtype": "float32"}, "train": {"mode": "lora", "adapter": "lora"}}


def _config(tmp_path, resume=None, **changes):
    data = {"workdir": str(tmp_path), "model": dict(MADE["model"]), "train": dict(MADE["train"], resume=resume)}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        data[section][key] = value
    return parse_config(data, "<test>")


def _checkpoint(tmp_path, state: dict):
    """A checkpoint as the trainer saves it (tuneline.stages.train.loop.Trainer.checkpoint records made_with)."""
    return ckpt.save(tmp_path / "made", 4, {"trainable": {"w": torch.ones(2)}}, state)


@pytest.mark.parametrize(
    ("change", "field", "was", "now"),
    [
        ({"train__optimizer": "lion"}, "train.optimizer", "adamw", "lion"),
        ({"train__adapter": "lokr"}, "train.adapter", "lora", "lokr"),
        ({"train__mode": "full"}, "train.mode", "lora", "full"),
        ({"model__dtype": "bfloat16"}, "model.dtype", "float32", "bfloat16"),
        ({"train__mixed_precision": "bf16"}, "train.mixed_precision", "auto", "bf16"),
        ({"model__family": "sd15"}, "model.family", "tiny", "sd15"),
    ],
)
def test_a_checkpoint_made_with_other_settings_is_refused_before_training(tmp_path, change, field, was, now):
    made = _checkpoint(tmp_path, {"made_with": ckpt.made_with(_config(tmp_path))})
    cfg = _config(tmp_path, resume=str(made), **change)
    work = tmp_path / "work"
    with pytest.raises(TrainingFailed) as err:
        resume_target(StageContext(cfg), work)
    msg = str(err.value)
    assert f"{field} {was} (the config says {now})" in msg
    fix = msg.split(": set ", 1)[1]
    assert f"{field}: {was}" in fix.split(" to continue it")[0] and "or set train.resume to null" in fix
    assert not work.exists(), "nothing was started"


def test_the_same_settings_resume(tmp_path):
    made = _checkpoint(tmp_path, {"made_with": ckpt.made_with(_config(tmp_path))})
    assert resume_target(StageContext(_config(tmp_path, resume=str(made))), tmp_path / "work") == made


def test_a_checkpoint_without_the_record_is_refused_clearly(tmp_path):
    made = _checkpoint(tmp_path, {"mode": "lora", "family": "tiny"})  # as checkpoints were written before
    assert "made_with" not in json.loads((made / "state.json").read_text())
    with pytest.raises(TrainingFailed, match=r"does not record the optimizer, adapter and dtypes it was made with"):
        resume_target(StageContext(_config(tmp_path, resume=str(made))), tmp_path / "work")
