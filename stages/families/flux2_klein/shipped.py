"""The shapes of the released FLUX.2 [klein] 4B transformer that its shipped config (stages/families/configs/flux2_klein/) describes:
a transformer file given with that config must have them (stages/families/shipped.py). Names as in the file
ComfyUI distributes (Black Forest Labs' layout), after its `model.diffusion_model.` prefix."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    "img_in.weight": (3072, 128),
    "txt_in.weight": (3072, 7680),
    "double_blocks.0.img_attn.qkv.weight": (9216, 3072),
    "double_blocks.4.img_attn.qkv.weight": (9216, 3072),
    "single_blocks.19.linear1.weight": (27648, 3072),
}
