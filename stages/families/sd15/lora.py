"""The sd15 kohya LoRA layout: the diffusers UNet's names (sd-scripts trains SD1.x on a UNet with diffusers'
names), e.g. `lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`."""

from __future__ import annotations

from tuneline.stages.families.kohya_layout import Target

KOHYA_LAYOUT = "unet"
# train.text_encoder_lora: the CLIP encoder's kohya prefix (ComfyUI maps lora_te_text_model_... onto CLIP)
TEXT_ENCODER_KOHYA = (("text_encoder", "lora_te"),)


def kohya_target(path: str, den) -> Target:
    return Target(path)
