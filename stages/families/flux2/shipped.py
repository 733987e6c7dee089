"""The shapes of the released FLUX.2 [dev] transformer that its shipped config (stages/families/configs/flux2/) describes:
a transformer file given with that config must have them (stages/families/shipped.py). Names as in the file
ComfyUI distributes (Black Forest Labs' layout), after its `model.diffusion_model.` prefix."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    "img_in.weight": (6144, 128),
    "txt_in.weight": (6144, 15360),
    "double_blocks.0.img_attn.qkv.weight": (18432, 6144),
    "double_blocks.7.img_attn.qkv.weight": (18432, 6144),
    "single_blocks.47.linear1.weight": (55296, 6144),
    "guidance_in.in_layer.weight": (6144, 256),
}
