"""The ComfyUI LoRA layout of Z-Image: ComfyUI loads Z-Image as its Lumina2 model, and `comfy/lora.py` maps keys
`diffusion_model.<diffusers path>` (also `transformer.`, `lycoris_`) for each module `comfy/utils.py:
z_image_to_diffusers` lists: in the main layers and both refiners the attention projections (q/k/v into its fused
qkv, to_out.0), the feed-forward w1-w3 and the adaLN modulation."""

from __future__ import annotations

import re

import torch

from tuneline.stages.families.comfy_lora import comfy_state

PREFIX = "diffusion_model."
MAPPED = re.compile(
    r"^(layers|context_refiner|noise_refiner)\.\d+\."
    r"(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|adaLN_modulation\.0)$"
)


def z_image_comfy_state(peft_state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    return comfy_state(peft_state, alpha, PREFIX, MAPPED, "Z-Image")
