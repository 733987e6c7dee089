"""Qwen-Image-Edit's pipelines scale every input image to about 1 MP whatever the output size. The tiny flavor
(model.path null) scales them to its own area, the demo's 64 x 64, at every place an input is encoded: the latents
stage's control size, the text encoder's picture and the stock pipeline's inputs at render time; a model folder
keeps the pipeline's 1 MP."""

from __future__ import annotations

import pytest
from PIL import Image

from tuneline.schemas.config import parse_config
from tuneline.schemas.demo import DEMO_CONFIG
from tuneline.stages.families import resolve
from tuneline.stages.families.qwen_image_edit.adapter import prompt_image
from tuneline.stages.families.qwen_image_edit.inputs import scaled_inputs, with_input_area
from tuneline.stages.families.qwen_image_edit_plus.adapter import condition_image
from tuneline.stages.families.registry import get_family

EDIT = ("qwen_image_edit", "qwen_image_edit_plus")


def _cfg(family: str, path: str | None):
    return parse_config({**DEMO_CONFIG, "model": {"family": family, "path": path}})


@pytest.mark.parametrize("family", EDIT)
def test_the_tiny_flavor_caches_controls_at_the_demo_size_and_a_model_folder_at_1_mp(family, tmp_path):
    tiny, folder = resolve.input_area(_cfg(family, None)), resolve.input_area(_cfg(family, str(tmp_path)))
    assert (tiny, folder) == (64 * 64, None)
    fam = get_family(family)
    assert fam.control_size(64, 64, tiny) == (64, 64)
    assert fam.control_size(128, 64, tiny) == (96, 32)  # about 4,096 pixels at 2:1, multiples of 32
    assert fam.control_size(64, 64, folder) == (1024, 1024)
    assert resolve.input_area(_cfg("flux_kontext", None)) is None  # its pipeline encodes inputs at the output size


def test_the_text_encoder_sees_the_input_at_the_runs_area():
    image = Image.new("RGB", (64, 32), (200, 30, 30))
    assert prompt_image(image, 64 * 64).size == (96, 32)
    assert prompt_image(image).size == (1440, 736)  # QwenImageEditPipeline's calculate_dimensions(1024 * 1024, 2)
    assert condition_image(image, 64 * 64).size == (96, 32)
    assert condition_image(image).size == (544, 256)  # the Plus pipeline's CONDITION_IMAGE_SIZE, 384 x 384


@pytest.mark.parametrize("pipeline", ["QwenImageEditPipeline", "QwenImageEditPlusPipeline"])
def test_the_stock_pipeline_sizes_inputs_for_the_runs_area_only_during_its_call(pipeline):
    """The pipelines size every input image (VAE input, text encoder picture, token grid) with their module's
    calculate_dimensions; a run's call answers its own area there, and leaves the module as it was."""
    import sys

    import diffusers

    cls = getattr(diffusers, pipeline)
    module = sys.modules[cls.__module__]
    pipe = cls.__new__(cls)  # the class is what decides the module; nothing else of the pipeline is read
    released = module.calculate_dimensions(1024 * 1024, 2.0)[:2]
    with scaled_inputs(pipe, 64 * 64):
        assert module.calculate_dimensions(1024 * 1024, 2.0)[:2] == (96, 32)
        assert module.calculate_dimensions(384 * 384, 1.0)[:2] == (64, 64)
    assert module.calculate_dimensions(1024 * 1024, 2.0)[:2] == released == (1440, 736)
    assert with_input_area(pipe, None) is pipe
