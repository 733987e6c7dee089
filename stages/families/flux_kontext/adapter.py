"""FLUX.1 Kontext [dev]: FLUX.1's transformer, text encoders and VAE; the input (control) image's latents are packed
into tokens and appended to the generated image's tokens, with position ids whose first coordinate is 1, as
diffusers' FluxKontextPipeline builds them. The transformer predicts for every token; the loss is on the target's.

With no control in the batch (dataset.control null) it trains and renders as text-to-image, as the pipeline does
without an image.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tuneline.schemas.families import FAMILY_FACTS, FamilyFacts
from tuneline.stages.families.base import MicroCond
from tuneline.stages.families.common import unwrap
from tuneline.stages.families.flux.adapter import FluxFamily, image_ids, pack_latents, unpack_latents
from tuneline.stages.families.tiny.adapter import demo_pictures, demo_vae_widened

# The conditioning key the training loop fills from the cached control latents (scaled like the targets).
CONTROL_KEY = "control_latents"


def control_ids(height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Position ids of the packed control tokens: (1, row, column), as FluxKontextPipeline.prepare_latents sets
    image_ids[..., 0] = 1 to tell the input image from the generated one."""
    ids = image_ids(height, width, device, dtype)
    ids[:, 0] = 1
    return ids


class FluxKontextFamily(FluxFamily):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["flux_kontext"]
    # The training loop hands this family the batch's control latents (stages/latents/controls.py).
    takes_control: ClassVar[bool] = True

    # Wider and deeper than Flux's tiny flavor, so it learns the demo's edit at the demo's settings (docs/editing.md
    # has the measurements).
    tiny_transformer: ClassVar[dict[str, Any]] = FluxFamily.tiny_transformer | {
        "num_layers": 2,
        "num_single_layers": 2,
        "num_attention_heads": 4,
    }

    def tiny_vae(self) -> torch.nn.Module:
        """The demo's pretrained VAE (the tiny family's, stages/families/tiny) re-laid for 16 latent channels:
        decoded edits show the instructed color and shape, and latents carry the picture rather than a random
        projection of it. Scale and shift are measured the way the released 0.3611 / 0.1159 were chosen (mean and
        1 / std of the latents of a shape in each demo color on a grey ground)."""
        vae = demo_vae_widened(self.facts)
        with torch.no_grad():
            latents = vae.encode(demo_pictures()).latent_dist.mean
        vae.register_to_config(shift_factor=float(latents.mean()), scaling_factor=float(1 / latents.std()))
        return vae

    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """FluxFamily.denoise with the control tokens appended (FluxKontextPipeline's
        `torch.cat([latents, image_latents], dim=1)`); only the target tokens' prediction comes back."""
        control = text.get(CONTROL_KEY)
        if control is None:
            return super().denoise(denoiser, noisy, timesteps, text, micro)
        b, _, h, w = noisy.shape
        dt, dev = noisy.dtype, noisy.device
        if tuple(control.shape) != tuple(noisy.shape):
            raise ValueError(f"control latents {tuple(control.shape)} do not match the targets {tuple(noisy.shape)}")
        target = pack_latents(noisy)
        embeds = text["prompt_embeds"].to(device=dev, dtype=dt)
        guidance = None
        if getattr(unwrap(denoiser).config, "guidance_embeds", False):
            guidance = torch.full((b,), self.train_guidance, device=dev, dtype=torch.float32)
        out = denoiser(
            hidden_states=torch.cat([target, pack_latents(control.to(dev, dt))], dim=1),
            timestep=timesteps.to(dev, dt) / 1000,
            guidance=guidance,
            pooled_projections=text["pooled_prompt_embeds"].to(device=dev, dtype=dt),
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=dev, dtype=dt),
            img_ids=torch.cat([image_ids(h, w, dev, dt), control_ids(h, w, dev, dt)]),
            return_dict=False,
        )[0]
        return unpack_latents(out[:, : target.shape[1]], h, w)

    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        """Pipeline arguments for rendering at width x height, from input images already at that size (None: text
        to image). FluxKontextPipeline rescales its output to `max_area` (1024^2 by default), so that is the render
        size's area; its own resize of the input to the preferred Kontext resolutions is off (`_auto_resize`, a
        documented call argument), so the input is seen at the size training saw it (its image's)."""
        kwargs: dict[str, Any] = {"max_area": width * height}
        if images is not None:
            kwargs |= {"image": images, "_auto_resize": False}
        return kwargs

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        """The pipeline's output_type="latent" result (B, tokens, C*4) as (B, C, H, W) denoiser-space latents."""
        f = self.facts.vae_factor
        return unpack_latents(latents, height // f, width // f)
