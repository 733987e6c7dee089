"""The wan kohya LoRA layout: `lora_unet_` + the module's name in Wan's original layout (ComfyUI holds Wan in that
layout and `comfy/lora.py` maps `lora_unet_<key with _>` for every `diffusion_model.` weight; musubi-tuner writes
the same names), for the blocks' self-attention and cross-attention q, k, v, o and feed-forward ffn.0, ffn.2,
e.g. `lora_unet_blocks_0_self_attn_q`."""

from __future__ import annotations

import re

from tuneline.stages.families.kohya_layout import Target

KOHYA_LAYOUT = "wan"
# diffusers module (inside blocks.N.) -> the original layout's
ORIGINAL = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def kohya_target(path: str, den) -> Target | None:
    m = BLOCK.match(path)
    return Target(f"blocks.{m[1]}.{ORIGINAL[m[2]]}") if m and m[2] in ORIGINAL else None
