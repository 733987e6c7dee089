"""The qwen_image kohya LoRA layout: `lora_unet_` + the diffusers module path (ComfyUI's Qwen-Image model has
diffusers' module names, and comfy/lora.py maps `lora_unet_<path with _>` for every `diffusion_model.` weight),
e.g. `lora_unet_transformer_blocks_0_attn_to_q`."""

from __future__ import annotations

from tuneline.stages.families.kohya_layout import Target

KOHYA_LAYOUT = "diffusers"


def kohya_target(path: str, den) -> Target:
    return Target(path)
