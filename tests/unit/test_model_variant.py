"""A family's other layout (FamilyFacts.variant_of: Wan 2.2's TI2V 5B) as the config picks it: the model folder
decides the row either way, values of the wrong type reach the field checks, a shipped config name is never read as
a folder; and the refusals that name the row of the other layout as the fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tuneline.schemas.config import ConfigError, parse_config
from tuneline.schemas.families import variant_family
from tuneline.stages.families.shipped import SIGNATURES, resolve_config, shipped_dir
from tuneline.stages.families.wan22.adapter import folder_experts

TI2V = "wan22_ti2v"


def _folder(path, **index):
    path.mkdir()
    (path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"} | index))
    return path


def test_a_ti2v_row_with_an_a14b_folder_trains_the_a14b_layout(tmp_path):
    """A dumped config or a form naming the TI2V row with an A14B folder: the folder decides, as it does the other
    way round (a TI2V folder under model.family wan22)."""
    a14b = _folder(tmp_path / "a14b", boundary_ratio=0.875)
    model = parse_config({"model": {"family": TI2V, "path": str(a14b)}}, workdir=str(tmp_path)).model
    assert model.family == "wan22"
    ti2v = _folder(tmp_path / "ti2v", expand_timesteps=True)
    assert parse_config({"model": {"family": TI2V, "path": str(ti2v)}}, workdir=str(tmp_path)).model.family == TI2V


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"path": 5}, "model.path"),
        ({"path": "x.safetensors", "config": ["a"]}, "model.config"),
        ({"family": 5}, "model.family"),
    ],
)
def test_values_of_the_wrong_type_are_named_by_their_field(model, field, tmp_path):
    with pytest.raises(ConfigError, match=field):
        parse_config({"model": {"family": "wan22"} | model}, workdir=str(tmp_path))


def test_an_unknown_users_home_is_no_crash(tmp_path):
    with pytest.raises(ConfigError, match="model.path: ~nosuchuser-tuneline/x .* a user this machine does not know"):
        parse_config({"model": {"family": "wan22", "path": "~nosuchuser-tuneline/x"}}, workdir=str(tmp_path))
    assert variant_family("wan22", None, "~nosuchuser-tuneline/x") is None
    assert variant_family("wan22", "~nosuchuser-tuneline/c", str(tmp_path / "t.safetensors")) is None


def test_a_shipped_name_is_not_read_as_a_folder_and_a_config_folder_only_beside_a_file(tmp_path, monkeypatch):
    _folder(tmp_path / "wan22", expand_timesteps=True)
    monkeypatch.chdir(tmp_path)
    assert variant_family("wan22", "wan22", str(tmp_path / "t.safetensors")) is None
    beside = _folder(tmp_path / "ti2v", expand_timesteps=True)
    assert variant_family("wan22", str(beside), str(tmp_path / "t.safetensors")) == TI2V
    (tmp_path / "other").mkdir()  # a folder as model.path: its own model_index.json, not model.config's
    assert variant_family("wan22", str(beside), str(tmp_path / "other")) is None


@pytest.mark.parametrize("config", [None, "wan22"])
def test_a_ti2v_file_under_wan22_is_told_to_set_its_shipped_config(config, tmp_path):
    """A ComfyUI TI2V 5B transformer file (patch_embedding of 48 input channels) under model.family wan22."""
    file = tmp_path / "ti2v.safetensors"
    save_file({k: torch.zeros(s, dtype=torch.uint8) for k, s in SIGNATURES[TI2V].items()}, str(file))
    assert SIGNATURES[TI2V]["patch_embedding.weight"][1] == 48
    with pytest.raises(ValueError, match=f"does not fit .* set model.config {TI2V}$"):
        resolve_config("wan22", file, config)
    assert resolve_config(TI2V, file, TI2V) == (str(shipped_dir(TI2V)), True)


def test_the_a14b_code_refusing_a_ti2v_folder_names_its_row(tmp_path):
    folder = _folder(tmp_path / "ti2v", expand_timesteps=True)
    with pytest.raises(ValueError, match=f"expand_timesteps is true.*set model.config {TI2V}.*readable"):
        folder_experts(folder)
