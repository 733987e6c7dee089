"""The shapes of the released sd3 model that its shipped config (stages/families/configs/sd3/) describes: a
single checkpoint file given with that config must have them (stages/families/shipped.py)."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
# The MMDiT and Flux transformers' names as in the original files, with or without ComfyUI's
# "model.diffusion_model." prefix (BFL's flux1-dev.safetensors has none): the patch embedding (latent channels,
# width), the first and last block (width, depth), the text projections (T5 / pooled CLIP widths) and what
# tells SD3 medium from SD3.5 (its 384-position embedding) and FLUX.1-dev from schnell (no guidance input).
SIGNATURE: dict[str, tuple[int, ...]] = {
    "x_embedder.proj.weight": (1536, 16, 2, 2),
    "pos_embed": (1, 192 * 192, 1536),
    "joint_blocks.0.x_block.attn.qkv.weight": (3 * 1536, 1536),
    "joint_blocks.23.context_block.attn.qkv.weight": (3 * 1536, 1536),
    "context_embedder.weight": (1536, 4096),
    "y_embedder.mlp.0.weight": (1536, 2048),
}
