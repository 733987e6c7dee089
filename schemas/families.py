"""Static facts of each model family that configs are checked against.

The adapters in stages/families/ read these same facts, so a config check and the code that runs agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    vae_factor: int
    patch_size: int
    latent_channels: int
    scaling_factor: float
    shift_factor: float
    prediction: Literal["epsilon", "v_prediction", "flow_matching"]
    max_length: int
    # Longest caption (tokens) the main text encoder embeds: CLIP's position table, or T5's declared 512.
    max_length_limit: int
    # Whether a negative prompt only takes effect through classifier-free guidance (guidance_scale > 1).
    # False where the pipeline applies it by other means (Flux: true CFG at its own scale).
    negative_needs_guidance: bool = True
    # Folder layout (diffusers pipeline class and component subfolders): read without loading anything.
    pipeline: str = "StableDiffusionPipeline"
    denoiser: str = "unet"
    text_encoders: tuple[str, ...] = ("text_encoder",)
    tokenizers: tuple[str, ...] = ("tokenizer",)
    # Bump when the tiny flavor's configs or tokenizer change, so stale cached folders are not reused.
    tiny_revision: str = "1"

    @property
    def alignment(self) -> int:
        """Smallest pixel multiple a bucket edge may have: one latent patch."""
        return self.vae_factor * self.patch_size


# Scaling/shift factors are the published SD/SDXL/SD3/Flux VAE values (tiny: measured on its pretrained demo VAE,
# see stages/families/tiny.py); a real model's own VAE config wins at run time.
FAMILY_FACTS: dict[str, FamilyFacts] = {
    "tiny": FamilyFacts("tiny", 8, 1, 4, 0.6722, 0.0, "epsilon", 16, max_length_limit=16, tiny_revision="3"),
    "sd15": FamilyFacts("sd15", 8, 1, 4, 0.18215, 0.0, "epsilon", 77, max_length_limit=77),
    "sdxl": FamilyFacts("sdxl", 8, 1, 4, 0.13025, 0.0, "epsilon", 77, max_length_limit=77,
                        pipeline="StableDiffusionXLPipeline", text_encoders=("text_encoder", "text_encoder_2"),
                        tokenizers=("tokenizer", "tokenizer_2")),
    "sd3": FamilyFacts("sd3", 8, 2, 16, 1.5305, 0.0609, "flow_matching", 77, max_length_limit=512,
                       pipeline="StableDiffusion3Pipeline", denoiser="transformer",
                       text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
                       tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3")),
    "flux": FamilyFacts("flux", 8, 2, 16, 0.3611, 0.1159, "flow_matching", 512, max_length_limit=512,
                        negative_needs_guidance=False, pipeline="FluxPipeline", denoiser="transformer",
                        text_encoders=("text_encoder", "text_encoder_2"), tokenizers=("tokenizer", "tokenizer_2")),
    # Z-Image: Flux.1's VAE, 2x2 patches inside the transformer, Qwen3 captions of up to 512 chat-template tokens.
    "z_image": FamilyFacts("z_image", 8, 2, 16, 0.3611, 0.1159, "flow_matching", 512, max_length_limit=512,
                           pipeline="ZImagePipeline", denoiser="transformer"),
    # FLUX.2: 32 VAE channels, 2x2 patchified into 128 and batch-norm normalised (cached that way: scale 1, shift 0).
    "flux2": FamilyFacts("flux2", 8, 2, 32, 1.0, 0.0, "flow_matching", 512, max_length_limit=512,
                         negative_needs_guidance=False, pipeline="Flux2Pipeline", denoiser="transformer"),
    "flux2_klein": FamilyFacts("flux2_klein", 8, 2, 32, 1.0, 0.0, "flow_matching", 512, max_length_limit=512,
                               negative_needs_guidance=True, pipeline="Flux2KleinPipeline", denoiser="transformer"),
}


def facts(name: str) -> FamilyFacts:
    try:
        return FAMILY_FACTS[name]
    except KeyError:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(FAMILY_FACTS)}") from None
