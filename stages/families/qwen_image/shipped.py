"""The shapes of the released Qwen-Image transformer that its shipped config (stages/families/configs/qwen_image/) describes:
a transformer file given with that config must have them (stages/families/shipped.py). Names as in the file
ComfyUI distributes (diffusers' module names), after its `model.diffusion_model.` prefix."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    "img_in.weight": (3072, 64),
    "txt_in.weight": (3072, 3584),
    "transformer_blocks.0.attn.to_q.weight": (3072, 3072),
    "transformer_blocks.59.img_mod.1.weight": (18432, 3072),
    "proj_out.weight": (64, 3072),
}
