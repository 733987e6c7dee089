"""A corrupted validation-prompt cache is rebuilt (it carries a checksum), and renders that are NaN or one flat
color are refused, never published as black squares with exit code 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tuneline.stages.families.registry import get_family
from tuneline.stages.render import renderer as render
from tuneline.stages.render.prompts import load_prompts
from tuneline.stages.render.renderer import Renderer, Sample

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return get_family("tiny").ensure_model(None, tmp_path_factory.mktemp("models"))


def _nan_out(cache):
    """The cache file with every tensor's data set to NaN, its metadata kept (what a bit-flip or an edit does)."""
    with safe_open(str(cache), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: torch.full_like(f.get_tensor(k), float("nan")) for k in f.keys()}
    save_file(tensors, str(cache), metadata=meta)


def test_a_corrupted_prompt_cache_is_rebuilt_and_renders_stay_right(model_dir, tmp_path):
    fam = get_family("tiny")
    cache = tmp_path / ".cache" / "validation-prompts.safetensors"
    samples = [Sample("a red square", "", 2), Sample("a blue circle", "", 3)]
    first = Renderer.load(fam, model_dir, CPU, torch.float32, prompt_cache=(cache, "k"))
    good = [np.asarray(i) for i in first.render(samples, 64, 64, 2, 4.0)]
    _nan_out(cache)
    assert load_prompts(cache, "k") == {}
    again = Renderer.load(fam, model_dir, CPU, torch.float32, prompt_cache=(cache, "k"))
    for a, b in zip(good, again.render(samples, 64, 64, 2, 4.0)):
        assert np.array_equal(a, np.asarray(b))
    assert set(load_prompts(cache, "k")) == {"a red square", "a blue circle"}  # rewritten whole


def test_nan_or_flat_renders_are_refused():
    s, check_render, BadRender = Sample("a red square", "", 1), render.check_render, render.BadRender
    check_render(np.random.default_rng(0).random((8, 8, 3)), s)
    with pytest.raises(BadRender, match="NaN"):
        check_render(np.full((8, 8, 3), np.nan), s)
    with pytest.raises(BadRender, match="flat"):
        check_render(np.zeros((8, 8, 3)), s)


def test_a_model_with_nan_weights_fails_to_render(model_dir):
    fam = get_family("tiny")
    r = Renderer.load(fam, model_dir, CPU, torch.float32)
    with torch.no_grad():
        for p in r.pipe.unet.parameters():
            p.fill_(float("nan"))
    with pytest.raises(render.BadRender):
        r.render([Sample("a red square", "", 1)], 64, 64, 2, 4.0)
