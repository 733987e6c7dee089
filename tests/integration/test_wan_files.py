"""The files a Wan user loads: the diffusers LoRA file in the stock WanPipeline renders as trained (a clip's
latents), and the kohya file holds only keys ComfyUI maps for Wan (Wan's original names), each pair's
alpha/rank * up @ down the trained update of its diffusers module."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from tests.integration import comfy_lora_keys
from tests.integration.family_runs import lift_lora_up, tiny_models
from tuneline.schemas.train import TrainConfig
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.wan.lora import ORIGINAL
from tuneline.stages.render.renderer import Renderer, Sample
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final

CPU = torch.device("cpu")
RANK, ALPHA, LENGTH = 4, 2.0, 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny Wan model and a LoRA on it with random nonzero up weights, saved as the train stage saves it."""
    root = tmp_path_factory.mktemp("wan-files")
    model_dir = tiny_models(root)("wan")
    fam = get_family("wan")
    t = TrainConfig(mode="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_format="both")
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    lift_lora_up(trainable, 0.2)
    save_final(fam, model_dir, den, t, root / "final")
    return fam, model_dir, den, root / "final"


def _render(fam, pipe) -> torch.Tensor:
    """The validation renderer's 5-frame clip latents (16, 2, 4, 4) from `pipe`, one prompt with a negative."""
    renderer = Renderer(fam, pipe, fam.text_encoders_of(pipe, LENGTH), CPU)
    sample = Sample("a square moves left", "blue", 0)
    return renderer.render([sample], 32, 32, 2, 3.0, output_type="latent", frames=5)[0]


def test_lora_file_in_stock_pipeline_renders_as_trained(trained):
    fam, model_dir, den, final = trained
    with torch.no_grad():
        want = _render(fam, fam.load_pipeline(model_dir, torch.float32, CPU, denoiser=unwrap(den).eval()))
        stock = fam.load_pipeline(model_dir, torch.float32, CPU)
        base = _render(fam, stock)
        stock.load_lora_weights(final, weight_name=DIFFUSERS_FILE)
        got = _render(fam, stock)
    assert want.shape == (16, 2, 4, 4)
    assert not torch.allclose(base, want, atol=1e-4), "the LoRA must change the render"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_comfy_file_uses_only_keys_comfyui_maps_for_wan(trained):
    fam, _, den, final = trained
    mapped = comfy_lora_keys.unet_stems(unwrap(den))
    state = load_file(final / KOHYA_FILE)
    stems = comfy_lora_keys.stems(state)
    assert stems and stems <= mapped, sorted(stems - mapped)[:5]
    assert all(s.startswith("lora_unet_blocks_") for s in stems)
    down = [k for k in state if k.endswith("lora_down.weight")]
    # every LoRA target of every block: self- and cross-attention q, k, v, o and ffn.0, ffn.2 (10 per block)
    assert len(down) == 10 * len(unwrap(den).blocks)
    modules = dict(unwrap(den).named_modules())
    diffusers_name = {v.replace(".", "_"): k for k, v in ORIGINAL.items()}  # self_attn_q -> attn1.to_q
    for k in down:
        stem = k.removesuffix(".lora_down.weight")
        block, rest = re.fullmatch(r"lora_unet_blocks_(\d+)_(.+)", stem).groups()
        mod = modules[f"blocks.{block}.{diffusers_name[rest]}"]
        delta = state[f"{stem}.alpha"] / RANK * state[f"{stem}.lora_up.weight"] @ state[k]
        want = (ALPHA / RANK) * mod.lora_B["default"].weight @ mod.lora_A["default"].weight
        torch.testing.assert_close(delta, want.detach())
