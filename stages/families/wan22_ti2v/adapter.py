"""Wan 2.2 TI2V 5B, trained text-to-video: one WanTransformer3DModel (Wan 2.1's, 48 latent channels in and out) on
the Wan 2.2 VAE (AutoencoderKLWan with is_residual, 2x2 pixel patches then 8x: 16x spatial, 4x temporal like Wan
2.1's; its own per-channel latents_mean / latents_std), in a WanPipeline folder with expand_timesteps true.

expand_timesteps: WanPipeline gives the transformer one timestep per video token, (B, latent frames x h/2 x w/2),
instead of one per sample. For text-to-video (no image) diffusers' WanPipeline fills them all with the step's
timestep (its mask is all ones); only WanImageToVideoPipeline zeroes the first latent frame's, the first-frame
conditioning of image-to-video. Training here is text-to-video and does the same: every token of a sample gets the
sample's timestep, and no frame is held clean. The LoRA then renders in the stock WanPipeline as trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.wan.adapter import Micro, WanFamily, demo_latent_stats, fold, unfold

Tensor = torch.Tensor
# The release's own text-to-video inference shift (sample_shift of Wan 2.2's ti2v_5B config): training
# draws its flow-matching noise levels with the folder's scheduler shift, as for Wan 2.1.
TI2V_SHIFT = 5.0


def tiny_vae() -> torch.nn.Module:
    """The Wan 2.2 VAE's layout (residual blocks, 2x2 pixel patches of 12 channels, z 48, 4x temporal in the last
    two levels), 8 channels wide, its latent statistics measured on the video demo's clips as the Wan 2.1 tiny's."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=FAMILY_FACTS["wan22_ti2v"].latent_channels,
        in_channels=12,
        out_channels=12,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        is_residual=True,
        patch_size=2,
        scale_factor_spatial=16,
        temperal_downsample=[False, True, True],
    )
    vae.register_to_config(**demo_latent_stats(vae))
    return vae


def token_timesteps(timesteps: Tensor, latents: Tensor, patch: int) -> Tensor:
    """WanPipeline's expand_timesteps for text-to-video: each sample's timestep for every one of its video tokens,
    (B,) -> (B, T * h/patch * w/patch) for latents (B, C, T, h, w)."""
    t, h, w = latents.shape[2:]
    return timesteps[:, None].expand(-1, t * (h // patch) * (w // patch))


class Wan22TI2VFamily(WanFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["wan22_ti2v"]

    def build_tiny(self, out_dir: Path) -> None:
        """A WanPipeline folder as the release's: expand_timesteps true, one transformer, the Wan 2.2 VAE."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        parts = self.tiny_components(out_dir) | {
            "vae": tiny_vae(),
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=TI2V_SHIFT),
        }
        self.pipeline_class(**parts, expand_timesteps=True).save_pretrained(out_dir, safe_serialization=True)

    def denoise(
        self, denoiser: torch.nn.Module, noisy: Tensor, timesteps: Tensor, text: dict[str, Tensor], micro: Micro = None
    ) -> Tensor:
        """Velocity for folded latents (B, 48, T*h, w), the timestep given per video token (module docstring)."""
        h = micro[0].target_size[0] // self.facts.vae_factor if micro else noisy.shape[2]
        latents = unfold(noisy, h)
        per_token = token_timesteps(timesteps.to(noisy.device), latents, self.facts.patch_size)
        embeds = text["prompt_embeds"].to(noisy.device, noisy.dtype)
        return fold(denoiser(latents, per_token, embeds, return_dict=False)[0])
