"""Qwen-Image's tiny flavor: scan -> validate on CPU (LoRA, and a full fine-tune), and its LoRA files read by stock
readers: the diffusers file through QwenImagePipeline.load_lora_weights gives the trained denoiser's output; the
kohya file's keys name only modules ComfyUI's Qwen-Image model has (its module names are diffusers')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests.integration.family_runs import export_info, lift_lora_up
from tuneline.schemas.config import parse_config
from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.train import TrainConfig
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.stage import StageContext, run_stage
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.registry import get_family
from tuneline.stages.pipeline import PIPELINE, stages_for
from tuneline.stages.train.export import DIFFUSERS_FILE, KOHYA_FILE
from tuneline.stages.train.model import prepare_denoiser, save_final

CPU = torch.device("cpu")
FAMILY = "qwen_image"
CAPTIONS = ["red, square, bright", "blue, circle", "green, circle, small", "yellow, square"]


def _run(root: Path, mode: str) -> tuple[StageContext, dict[str, Path]]:
    (root / "data").mkdir(parents=True)
    for i, caption in enumerate(CAPTIONS):
        Image.new("RGB", (64, 64), (60 * i, 140, 220 - 50 * i)).save(root / "data" / f"{i}.png")
        (root / "data" / f"{i}.txt").write_text(caption, encoding="utf-8")
    cfg = parse_config(
        {
            "dataset": {"path": str(root / "data")},
            "model": {"family": FAMILY, "path": None, "device": "cpu"},
            "buckets": {"resolution": 64},
            "text": {"max_length": 16},
            "train": {"steps": 2, "batch_size": 2, "processes": 1, "mode": mode},
            "validate": {"steps": 2, "prompts": [{"prompt": "red, square", "negative_prompt": "blue", "seed": 1}]},
        },
        workdir=str(root / "work"),
    )
    ctx = StageContext(cfg)
    return ctx, {sd.name: run_stage(ctx, sd, PIPELINE)[0] for sd in stages_for(ctx.cfg)}


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_scan_to_validate(mode, tmp_path):
    ctx, paths = _run(tmp_path, mode)
    lat = ctx.store.read(paths["latents"], LatentsManifest)
    assert len(lat.latents_mean) == len(lat.latents_std) == 16, "per-channel statistics recorded"
    train = ctx.store.read(paths["train"], TrainManifest)
    assert (train.family, train.step) == (FAMILY, 2)
    final = paths["train"] / "final"
    if mode == "lora":
        assert (final / DIFFUSERS_FILE).is_file() and (final / KOHYA_FILE).is_file()
    else:
        assert json.loads((final / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    val = ctx.store.read(paths["validate"], ValidateManifest)
    with Image.open(paths["validate"] / val.images[0].file) as img:
        assert img.size == (64, 64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real peft LoRA on the tiny transformer, up weights moved off zero, written by the train stage's save."""
    root = tmp_path_factory.mktemp("qwen-lora")
    fam = get_family(FAMILY)
    model_dir = fam.ensure_model(None, root / "models")
    t = TrainConfig(mode="lora", lora_rank=4, lora_alpha=2.0)
    den, trainable = prepare_denoiser(fam, model_dir, t, torch.float32, CPU)
    lift_lora_up(trainable, 0.05)
    save_final(fam, model_dir, den, t, root / "final", export_info())
    return fam, model_dir, den, root / "final"


def test_diffusers_lora_in_stock_pipeline_gives_the_trained_output(trained):
    fam, model_dir, den, final = trained
    enc = fam.load_text_encoders(model_dir, torch.float32, CPU)
    text = fam.encode_text(enc, ["a red square", "a blue circle"])
    noisy = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    steps = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        want = fam.denoise(den, noisy, steps, text)
        pipe = fam.load_pipeline(model_dir, torch.float32, CPU)
        base = fam.denoise(pipe.transformer, noisy, steps, text)
        pipe.load_lora_weights(final, weight_name=DIFFUSERS_FILE)
        got = fam.denoise(pipe.transformer, noisy, steps, text)
    assert not torch.allclose(base, want, atol=1e-4), "the LoRA must change the output"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_kohya_file_names_only_modules_comfyui_maps(trained):
    _, _, den, final = trained
    linears = {p for p, m in unwrap(den).named_modules() if hasattr(m, "lora_A")}
    stems = {
        k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in load_file(final / KOHYA_FILE)
    }
    # ComfyUI maps lora_unet_<diffusion_model weight path with "_"> for every weight of the model.
    assert stems == {"lora_unet_" + p.replace(".", "_") for p in linears}


def test_released_sizes_on_the_meta_device():
    """The released Qwen-Image shapes: the transformer and VAE at diffusers' defaults (they are Qwen/Qwen-Image's
    transformer/ and vae/ config.json values), the text encoder at Qwen2.5-VL-7B-Instruct's config. Counted without
    allocating; within 1 % of the published sizes (20.4B MMDiT, 8.29B Qwen2.5-VL-7B)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        transformer, vae = QwenImageTransformer2DModel(), AutoencoderKLQwenImage()
        text = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=dict(
                    vocab_size=152064,
                    hidden_size=3584,
                    intermediate_size=18944,
                    num_hidden_layers=28,
                    num_attention_heads=28,
                    num_key_value_heads=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                ),
                vision_config=dict(
                    depth=32,
                    hidden_size=1280,
                    intermediate_size=3420,
                    num_heads=16,
                    out_hidden_size=3584,
                    fullatt_block_indexes=[7, 15, 23, 31],
                ),
            )
        )

    def count(m):
        return sum(p.numel() for p in m.parameters())

    assert count(transformer) == pytest.approx(20.4e9, rel=0.01)
    assert count(text) == pytest.approx(8.29e9, rel=0.01)
    assert count(vae) == pytest.approx(126.9e6, rel=0.01)
