"""LoRA export settings and layouts: config fields refused naming them, in train's key and the example; kohya names
for full-size SDXL/Flux/SD3 module paths; fused layers' block-diagonal stacking; manifest exports checked against
the file list."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_config_checks import refused
from tuneline.schemas.base import FileEntry
from tuneline.schemas.config import example_yaml, parse_config
from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.train import kohya


def test_lora_format_is_checked_and_defaults_to_both():
    refused({"train": {"lora_format": "comfy"}}, "train.lora_format")
    refused({"train": {"metadata_captions": "sometimes"}}, "train.metadata_captions")
    cfg = parse_config({})
    assert cfg.train.lora_format == "both" and cfg.train.metadata_captions is False


def test_export_settings_are_in_the_train_key_and_the_example():
    from tuneline.stages.train import _config

    base = _config(parse_config({}))
    assert base["train"]["lora_format"] == "both" and base["train"]["metadata_captions"] is False
    assert _config(parse_config({"train": {"lora_format": "kohya"}})) != base
    assert _config(parse_config({"train": {"metadata_captions": True}})) != base
    text = example_yaml()
    assert "lora_format" in text and "metadata_captions" in text


SDXL_UNET = SimpleNamespace(config=SimpleNamespace(layers_per_block=2))


@pytest.mark.parametrize(
    "path,name",
    [
        # SDXL: level 0 has no attention; input_blocks 4,5 = level 1, 7,8 = level 2; output_blocks 0-2 = level 0 (the
        # deepest), 3-5 = level 1; middle_block.1 is the middle attention (sgm UNet, as sd-scripts writes SDXL LoRAs).
        (
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
            "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
        ),
        (
            "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_out.0",
            "lora_unet_input_blocks_8_1_transformer_blocks_9_attn2_to_out_0",
        ),
        (
            "up_blocks.0.attentions.2.transformer_blocks.3.attn1.to_k",
            "lora_unet_output_blocks_2_1_transformer_blocks_3_attn1_to_k",
        ),
        (
            "up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_v",
            "lora_unet_output_blocks_3_1_transformer_blocks_0_attn2_to_v",
        ),
        (
            "mid_block.attentions.0.transformer_blocks.0.attn1.to_q",
            "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_q",
        ),
    ],
)
def test_sdxl_kohya_names_are_the_original_unet_names(path, name):
    tg = kohya.target("sdxl", path, SDXL_UNET)
    assert kohya.kohya_name(tg.name) == name and not tg.parts


@pytest.mark.parametrize(
    "family,path,name,slot",
    [
        (
            "sd15",
            "down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k",
            "lora_unet_down_blocks_0_attentions_1_transformer_blocks_0_attn2_to_k",
            0,
        ),
        ("flux", "transformer_blocks.18.attn.to_v", "lora_unet_double_blocks_18_img_attn_qkv", 2),
        ("flux", "transformer_blocks.0.attn.to_out.0", "lora_unet_double_blocks_0_img_attn_proj", 0),
        ("flux", "transformer_blocks.3.attn.add_k_proj", "lora_unet_double_blocks_3_txt_attn_qkv", 1),
        ("flux", "single_transformer_blocks.37.attn.to_k", "lora_unet_single_blocks_37_linear1", 1),
        ("flux", "single_transformer_blocks.2.proj_mlp", "lora_unet_single_blocks_2_linear1", 3),
        ("sd3", "transformer_blocks.23.attn.to_q", "lora_unet_joint_blocks_23_x_block_attn_qkv", 0),
        ("sd3", "transformer_blocks.1.attn.to_out.0", "lora_unet_joint_blocks_1_x_block_attn_proj", 0),
        ("sd3", "transformer_blocks.1.attn2.to_v", "lora_unet_joint_blocks_1_x_block_attn2_qkv", 2),
    ],
)
def test_kohya_names(family, path, name, slot):
    tg = kohya.target(family, path, SDXL_UNET)
    assert (kohya.kohya_name(tg.name), tg.slot) == (name, slot)


def test_unknown_module_and_family_are_refused_naming_them():
    with pytest.raises(ValueError, match="train.lora_format"):
        kohya.layout("z_image")  # ComfyUI addresses Z-Image by its diffusers names: no kohya layout
    den = torch.nn.Module()
    den.add_module("proj", torch.nn.Linear(2, 2))
    state = {"proj.lora_A.weight": torch.ones(1, 2), "proj.lora_B.weight": torch.ones(2, 1)}
    with pytest.raises(ValueError, match=r"\['proj'\]"):
        kohya.to_kohya("sd3", den, state, 1.0)


def test_fused_parts_stack_block_diagonally_keeping_alpha_over_rank():
    """q, k trained (v not): down = [A_q; A_k], up = diag(B_q, B_k) in q's and k's rows, v's rows zero, alpha
    doubled with the doubled rank so alpha / rank, and each part's update, is unchanged."""
    attn = torch.nn.Module()
    for n in ("to_q", "to_k", "to_v"):
        attn.add_module(n, torch.nn.Linear(3, 5))
    block, den = torch.nn.Module(), torch.nn.Module()
    block.add_module("attn", attn)
    den.add_module("transformer_blocks", torch.nn.ModuleList([block]))
    g = torch.Generator().manual_seed(0)
    a = {n: torch.randn(2, 3, generator=g) for n in ("to_q", "to_k")}
    b = {n: torch.randn(5, 2, generator=g) for n in ("to_q", "to_k")}
    state = {
        f"transformer_blocks.0.attn.{n}.lora_{x}.weight": (a if x == "A" else b)[n]
        for n in ("to_q", "to_k")
        for x in "AB"
    }
    out = kohya.to_kohya("sd3", den, state, 1.5)
    stem = "lora_unet_joint_blocks_0_x_block_attn_qkv"
    down, up, alpha = out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"], out[f"{stem}.alpha"]
    assert down.shape == (4, 3) and up.shape == (15, 4) and float(alpha) == 3.0
    delta = alpha / down.shape[0] * up @ down
    torch.testing.assert_close(delta[:5], 1.5 / 2 * b["to_q"] @ a["to_q"])
    torch.testing.assert_close(delta[5:10], 1.5 / 2 * b["to_k"] @ a["to_k"])
    assert not delta[10:].any()


def _manifest(**exports_file) -> dict:
    return dict(
        fingerprint="f",
        tool_version="t",
        code_version="c",
        family="tiny",
        mode="lora",
        step=1,
        world_size=1,
        global_batch=1,
        checkpoint="checkpoints/step-0000001",
        **exports_file,
    )


def test_manifest_exports_must_match_the_listed_files():
    files = [
        FileEntry(path="final/lora_kohya.safetensors", bytes=10, sha256="a" * 64),
        FileEntry(path="final/x/y.json", bytes=3, sha256="b" * 64),
    ]
    good = {"file": "final/lora_kohya.safetensors", "format": "kohya", "bytes": 10, "sha256": "a" * 64}
    TrainManifest(
        **_manifest(files=files, exports=[good, {"file": "final", "format": "diffusers", "bytes": 13, "sha256": None}])
    )
    TrainManifest(**_manifest(exports=[{**good, "bytes": 11}]))  # before publishing there is no file list yet
    with pytest.raises(ValueError, match="exports: final/lora_kohya.safetensors"):
        TrainManifest(**_manifest(files=files, exports=[{**good, "sha256": "c" * 64}]))
    with pytest.raises(ValueError, match="exports: folder final"):
        TrainManifest(
            **_manifest(files=files, exports=[{"file": "final", "format": "diffusers", "bytes": 12, "sha256": None}])
        )
    with pytest.raises(ValueError, match="format"):
        TrainManifest(**_manifest(exports=[{**good, "format": "ckpt"}]))


def test_single_file_export_needs_a_full_fine_tune_of_a_supported_family():
    refused({"train": {"mode": "lora", "export_single_file": True}}, "train.export_single_file", "train.mode")
    refused({"model": {"family": "flux"}, "train": {"export_single_file": True}}, "train.export_single_file", "flux")
    assert parse_config({"train": {"export_single_file": True}}).train.export_single_file


def test_model_config_needs_a_single_file_path():
    refused({"model": {"config": "some/folder"}}, "model.config", "model.path")
