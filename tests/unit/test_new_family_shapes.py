"""The newer families' facts and released-size shapes: weightless shipped configs built on the meta device
(parameter counts), bucket alignment, the example config, and the full fine-tune refusal above DDP's limit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tuneline.schemas.config import example_yaml, parse_config
from tuneline.schemas.families import facts
from tuneline.stages.families import full_limit
from tuneline.stages.families.registry import family_names, get_family

FAMILIES_DIR = Path(__file__).resolve().parents[2] / "stages" / "families"
# (config folder, component, class, parameters of the published architecture, the model card's rounded size).
# Qwen-Image: 20.4B (its card states one decimal); Z-Image-Turbo: 6B; FLUX.2 [dev]: 32B; FLUX.2 [klein] 4B. See
# stages/families/configs/README.md.
SHAPES = [
    ("configs/qwen_image", "transformer", "QwenImageTransformer2DModel", 20_430_401_088, 20.4e9),
    ("configs/qwen_image", "vae", "AutoencoderKLQwenImage", 126_892_531, None),
    ("configs/z_image", "transformer", "ZImageTransformer2DModel", 6_154_908_736, 6e9),
    ("configs/flux2", "transformer", "Flux2Transformer2DModel", 32_223_281_152, 32e9),
    ("configs/flux2_klein", "transformer", "Flux2Transformer2DModel", 3_875_544_576, 4e9),
    ("configs/flux2", "vae", "AutoencoderKLFlux2", 84_046_115, None),
]


@pytest.mark.parametrize(("folder", "component", "cls", "count", "card"), SHAPES)
def test_released_size_parameter_counts(folder, component, cls, count, card):
    import diffusers

    config = json.loads((FAMILIES_DIR / folder / component / "config.json").read_text())
    n = full_limit.param_count(getattr(diffusers, cls), config)
    assert n == count
    if card:  # model cards round to whole billions
        assert abs(n - card) / card < 0.04


@pytest.mark.parametrize("name", ["z_image", "flux2", "flux2_klein"])
def test_family_facts_and_example_config(name):
    assert name in family_names()
    f = facts(name)
    assert f.alignment == 16 and f.prediction == "flow_matching" and f.denoiser == "transformer"
    assert get_family(name).facts is f
    # `tuneline config example` with model.family changed alone
    example = yaml.safe_load(example_yaml())
    example["model"]["family"] = name
    cfg = parse_config(example, workdir="/tmp/tuneline-example")
    assert cfg.model.family == name


def test_full_fine_tune_of_flux2_dev_refused_naming_the_limit(tmp_path):
    shutil.copytree(FAMILIES_DIR / "configs" / "flux2", tmp_path / "dev")
    with pytest.raises(ValueError, match=r"32\.2B parameters.*141 GB.*train.mode lora"):
        get_family("flux2").check_full_finetune(tmp_path / "dev")
    shutil.copytree(FAMILIES_DIR / "configs" / "z_image", tmp_path / "z")
    get_family("z_image").check_full_finetune(tmp_path / "z")  # 6.2B: 98 GB per GPU, fits the largest GPU
