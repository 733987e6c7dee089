"""model.expert: the families with timestep experts default to training both; a family with one denoiser refuses
the key naming it and the fix; the experts shard (FSDP) and swap blocks like any family."""

from __future__ import annotations

import pytest
import torch

from tuneline.schemas.config import parse_config
from tuneline.stages.families.registry import get_family
from tuneline.stages.train.swap import BlockSwapper, ExpertSwappers, block_swapper, transformer_blocks

CPU = torch.device("cpu")


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


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    fam = get_family("wan22")
    return fam, fam.ensure_model(None, tmp_path_factory.mktemp("models"))


@pytest.mark.parametrize("expert", [None, "both", "high", "low"])
@pytest.mark.parametrize("train", [{"parallelism": "fsdp", "processes": 2}, {"blocks_to_swap": 1, "mode": "lora"}])
def test_experts_shard_and_swap_for_every_choice(tmp_path, wan22, expert, train):
    """Each step trains one expert on every rank (SigmaSampler.step_share), so FSDP and block swap take both: the
    config is accepted, and the denoiser it loads has each held expert's own blocks to shard (fsdp.shard's units)
    or swap (one swapper per expert, each swapping train.blocks_to_swap of its own blocks)."""
    cfg = _parse(tmp_path, "wan22", {"expert": expert}, train)
    fam, model_dir = wan22
    den = fam.load_denoiser(model_dir, torch.float32, CPU, cfg.model.expert)
    held = {"high": ["transformer"], "low": ["transformer_2"]}.get(expert, ["transformer", "transformer_2"])
    parts = fam.denoiser_parts(den)
    assert list(parts) == held
    assert all(transformer_blocks(p, fam.block_stacks(p)) for p in parts.values())
    swapper = block_swapper(fam, den, cfg.train, CPU)
    if not cfg.train.blocks_to_swap:
        assert cfg.train.parallelism == "fsdp" and swapper is None
    elif len(held) == 2:
        assert isinstance(swapper, ExpertSwappers) and [s.resident_limit for s in swapper.swappers] == [
            len(s.blocks) - cfg.train.blocks_to_swap for s in swapper.swappers
        ]
    else:
        assert isinstance(swapper, BlockSwapper) and swapper.resident_limit == len(swapper.blocks) - 1


@pytest.mark.parametrize(
    "train, field",
    [
        ({"parallelism": "fsdp", "processes": 2, "blocks_to_swap": 1}, "train.blocks_to_swap"),
        ({"blocks_to_swap": 1, "mode": "full", "processes": 2}, "train.blocks_to_swap"),
    ],
)
def test_what_no_family_combines_is_refused_for_the_experts_too(tmp_path, train, field):
    """What stays refused with experts is what every family refuses: block swap under FSDP (which frees each
    block itself) or with a full fine-tune in several processes."""
    with pytest.raises(ValueError, match=rf"{field}.*set train"):
        _parse(tmp_path, "wan22", {"expert": "both"}, train)


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
