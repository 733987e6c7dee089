"""The shapes of the released sd15 model that its shipped config (stages/families/configs/sd15/) describes: a
single checkpoint file given with that config must have them (stages/families/shipped.py)."""

from __future__ import annotations

UNET = "model.diffusion_model."

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    UNET + "input_blocks.0.0.weight": (320, 4, 3, 3),
    UNET + "input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight": (320, 768),
    UNET + "middle_block.1.transformer_blocks.0.attn2.to_k.weight": (1280, 768),
    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": (49408, 768),
    "first_stage_model.encoder.conv_in.weight": (128, 3, 3, 3),
}
