"""model.path a single original-layout checkpoint, offline: with model.config (a local diffusers folder of the same
model: configs and tokenizers, its weights unread) it converts and trains; a checkpoint of another family is refused
naming both families; a model.config that is no pipeline folder is refused naming model.config."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.test_train_support import build_upstream, small_config, train
from tuneline.stages.families import resolve as models
from tuneline.stages.families.registry import get_family

CPU = torch.device("cpu")


def _single_file(family: str, tmp_path, shift: float = 0.0):
    """(original-layout file written from the family's tiny model with every UNet weight moved by `shift`, the
    tiny folder)."""
    fam = get_family(family)
    folder = fam.ensure_model(None, tmp_path / "models")
    pipe = fam.load_pipeline(folder, torch.float32, CPU)
    with torch.no_grad():
        for p in pipe.unet.parameters():
            p.add_(shift)
    path = tmp_path / f"{family}-checkpoint.safetensors"
    save_file(fam.single_file_state(pipe), str(path))
    return path, folder, pipe


def test_single_file_with_model_config_loads_offline_and_trains(tmp_path):
    path, folder, pipe = _single_file("sd15", tmp_path, shift=0.01)
    cfg = small_config(
        tmp_path / "work",
        {"mode": "lora", "lora_rank": 2, "steps": 2, "processes": 1, "batch_size": 2},
        model={"family": "sd15", "path": str(path), "config": str(folder), "device": "cpu"},
    )
    ctx = build_upstream(cfg)  # not the shared store: the conversion of the file is what is tested
    converted = models.model_dir(ctx)
    assert converted != folder and converted.is_dir()
    got = get_family("sd15").load_denoiser(converted, torch.float32, CPU).state_dict()
    want = pipe.unet.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (
        "the converted UNet is not the file's"
    )
    out = train(cfg)
    assert (out / "final" / "lora_kohya.safetensors").is_file()


def test_checkpoint_of_another_family_is_refused_naming_both(tmp_path):
    path, folder, _ = _single_file("sdxl", tmp_path)
    with pytest.raises(ValueError) as err:
        get_family("sd15").ensure_model(str(path), tmp_path / "cache", str(folder))
    msg = str(err.value)
    assert "is a sdxl checkpoint" in msg and "model.family is sd15" in msg and str(path) in msg


def test_model_config_must_be_a_pipeline_folder(tmp_path):
    path, _, _ = _single_file("sd15", tmp_path)
    with pytest.raises(ValueError, match="model.config"):
        get_family("sd15").ensure_model(str(path), tmp_path / "cache", str(tmp_path))
