"""The sdxl kohya LoRA layout: the original (sgm/LDM) UNet's names (sd-scripts trains SDXL on the original UNet),
e.g. `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`."""

from __future__ import annotations

import re

from tuneline.stages.families.kohya_layout import Target

KOHYA_LAYOUT = "sgm"
# train.text_encoder_lora: kohya's prefixes of the two CLIP encoders (ComfyUI maps them onto clip_l and clip_g)
TEXT_ENCODER_KOHYA = (("text_encoder", "lora_te1"), ("text_encoder_2", "lora_te2"))


def kohya_target(path: str, den) -> Target | None:
    """diffusers UNet path -> original SDXL UNet path. input_blocks.0 is conv_in, then each down level has
    layers_per_block (resnet, attention) layers and a downsampler; up levels have one layer more and no
    separate upsampler index; the middle block is (resnet, attention, resnet)."""
    per = den.config.layers_per_block
    if not isinstance(per, int):
        return None
    m = re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", path)
    if m:
        return Target(f"input_blocks.{1 + int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}")
    m = re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", path)
    if m:
        return Target(f"output_blocks.{int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}")
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", path)
    if m:
        return Target(f"middle_block.1.{m[1]}")
    return None
