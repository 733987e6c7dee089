"""The shapes of the released flux model that its shipped config (stages/families/configs/flux/) describes: a
single checkpoint file given with that config must have them (stages/families/shipped.py)."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    "img_in.weight": (3072, 64),
    "double_blocks.0.img_attn.qkv.weight": (3 * 3072, 3072),
    "double_blocks.18.img_attn.qkv.weight": (3 * 3072, 3072),
    "single_blocks.37.linear1.weight": (3 * 3072 + 4 * 3072, 3072),
    "txt_in.weight": (3072, 4096),
    "vector_in.in_layer.weight": (3072, 768),
    "guidance_in.in_layer.weight": (3072, 256),
}
