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
# (config folder, component, class, parameters of the published architecture, the published total): the element
# totals of the released safetensors (Hugging Face's `safetensors.total` for the repositories, quoted in public
# code; stages/families/configs/README.md). The FLUX.2 VAE's total also counts its batch-norm running statistics
# (buffers, 257 elements), which are not parameters.
SHAPES = [
    ("configs/qwen_image", "transformer", "QwenImageTransformer2DModel", 20_430_401_088, 20_430_401_088),
    ("configs/qwen_image", "vae", "AutoencoderKLQwenImage", 126_892_531, 126_892_531),
    ("configs/z_image", "transformer", "ZImageTransformer2DModel", 6_154_908_736, 6_154_908_736),
    ("configs/flux2", "transformer", "Flux2Transformer2DModel", 32_223_281_152, 32_223_281_152),
    ("configs/flux2_klein", "transformer", "Flux2Transformer2DModel", 3_875_544_576, 3_875_544_576),
    ("configs/flux2", "vae", "AutoencoderKLFlux2", 84_046_115, 84_046_372),
]


@pytest.mark.parametrize(("folder", "component", "cls", "count", "published"), SHAPES)
def test_released_size_parameter_counts(folder, component, cls, count, published):
    import diffusers

    config = json.loads((FAMILIES_DIR / folder / component / "config.json").read_text())
    n = full_limit.param_count(getattr(diffusers, cls), config)
    assert n == count
    assert abs(n - published) / published < 0.01


def _text_encoder(which: str):
    """The released text encoders from their published config values (Qwen/Qwen3-4B `config.json`, which Z-Image and
    FLUX.2 [klein] 4B use; Mistral Small 3.1 24B's, FLUX.2 [dev]'s conditioner), built on the meta device."""
    import torch
    import transformers as T

    with torch.device("meta"):
        if which == "qwen3_4b":
            c = T.Qwen3Config(
                vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
            )  # fmt: skip
            return T.Qwen3ForCausalLM(c)
        text = T.MistralConfig(
            vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        )  # fmt: skip
        vision = T.PixtralVisionConfig(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
            image_size=1540, patch_size=14, head_dim=64,
        )  # fmt: skip
        return T.Mistral3ForConditionalGeneration(
            T.Mistral3Config(
                text_config=text,
                vision_config=vision,
                spatial_merge_size=2,
                multimodal_projector_bias=False,
                tie_word_embeddings=False,
            )  # fmt: skip
        )


@pytest.mark.parametrize(("which", "published"), [("qwen3_4b", 4_022_468_096), ("mistral_small_3_1", 24_011_361_280)])
def test_released_text_encoder_parameter_counts(which, published):
    """Published totals of the text encoders' safetensors (stages/families/configs/README.md)."""
    n = sum(p.numel() for p in _text_encoder(which).parameters())
    assert abs(n - published) / published < 0.01 and n == published


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
    get_family("flux2").check_full_finetune(tmp_path / "dev", shards=4)  # 129 GB per GPU when split 4 ways
    shutil.copytree(FAMILIES_DIR / "configs" / "qwen_image", tmp_path / "qwen")
    with pytest.raises(ValueError, match=r"qwen_image transformer has 20\.4B parameters"):
        get_family("qwen_image").check_full_finetune(tmp_path / "qwen")  # every family is checked, not only three
    shutil.copytree(FAMILIES_DIR / "configs" / "z_image", tmp_path / "z")
    get_family("z_image").check_full_finetune(tmp_path / "z")  # 6.2B: 98 GB per GPU, fits the largest GPU
