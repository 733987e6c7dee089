"""The shapes of the released sdxl model that its shipped config (stages/families/configs/sdxl/) describes: a
single checkpoint file given with that config must have them (stages/families/shipped.py)."""

from __future__ import annotations

UNET = "model.diffusion_model."

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    UNET + "input_blocks.0.0.weight": (320, 4, 3, 3),
    UNET + "input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight": (640, 2048),
    UNET + "input_blocks.7.1.transformer_blocks.9.attn2.to_k.weight": (1280, 2048),
    UNET + "label_emb.0.0.weight": (1280, 2816),
    "conditioner.embedders.0.transformer.text_model.embeddings.token_embedding.weight": (49408, 768),
    "conditioner.embedders.1.model.token_embedding.weight": (49408, 1280),
    "first_stage_model.encoder.conv_in.weight": (128, 3, 3, 3),
}
