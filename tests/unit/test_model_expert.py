"""model.expert: the families with timestep experts default to training both; a family with one denoiser refuses
the key naming it and the fix, and what the experts do not support yet is refused at load."""

from __future__ import annotations

import pytest

from tuneline.schemas.config import parse_config


def _parse(tmp_path, family, model=None, train=None):
    data = {"model": {"family": family, "path": None, **(model or {})}, "train": train or {}}
    return parse_config(data, workdir=str(tmp_path))


def test_wan22_defaults_to_both_experts_and_takes_each_choice(tmp_path):
    assert _parse(tmp_path, "wan22").model.expert is None  # null: both
    for expert in ("high", "low", "both"):
        assert _parse(tmp_path, "wan22", {"expert": expert}).model.expert == expert


@pytest.mark.parametrize("family", ["wan", "sd15"])
def test_a_family_without_experts_refuses_the_key(tmp_path, family):
    with pytest.raises(ValueError, match=rf"model.expert high: model.family {family} has one denoiser.*wan22.*remove"):
        _parse(tmp_path, family, {"expert": "high"})


@pytest.mark.parametrize(
    "train, field",
    [
        ({"parallelism": "fsdp", "processes": 2}, "train.parallelism"),
        ({"blocks_to_swap": 1, "mode": "lora"}, "train.blocks_to_swap"),
    ],
)
def test_what_experts_do_not_support_yet_is_refused_naming_the_fix(tmp_path, train, field):
    with pytest.raises(ValueError, match=rf"{field}.*wan22.*set {field}"):
        _parse(tmp_path, "wan22", train=train)


def test_an_experts_eval_timesteps_must_meet_its_share_of_the_schedule(tmp_path):
    """The A14B's boundary 0.875: the default [200, 500, 800] are all the low-noise expert's."""
    with pytest.raises(
        ValueError,
        match=r"train.eval.timesteps \[200, 500, 800\]: none is in model.expert high's "
        r"share.*>= 875.*set train.eval.timesteps \[900, 950, 990\]",
    ):
        _parse(tmp_path, "wan22", {"expert": "high"}, {"eval": {}})
    assert _parse(tmp_path, "wan22", {"expert": "low"}, {"eval": {}}).train.eval.timesteps == [200, 500, 800]
    assert _parse(tmp_path, "wan22", {"expert": "high"}, {"eval": {"timesteps": [500, 900]}}).model.expert == "high"
