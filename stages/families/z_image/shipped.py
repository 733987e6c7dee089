"""The shapes of the released Z-Image-Turbo transformer that its shipped config (stages/families/configs/z_image/) describes:
a transformer file given with that config must have them (stages/families/shipped.py). Names as in the file
ComfyUI distributes (Z-Image's own layout, which ComfyUI's Lumina2 model reads), after its `model.diffusion_model.` prefix."""

from __future__ import annotations

# Original-layout tensor name -> shape in the released model.
SIGNATURE: dict[str, tuple[int, ...]] = {
    "x_embedder.weight": (3840, 64),
    "cap_embedder.1.weight": (3840, 2560),
    "layers.0.attention.qkv.weight": (11520, 3840),
    "layers.29.feed_forward.w1.weight": (10240, 3840),
    "noise_refiner.1.attention.qkv.weight": (11520, 3840),
    "context_refiner.1.attention.qkv.weight": (11520, 3840),
}
