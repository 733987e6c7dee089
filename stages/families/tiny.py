"""The demo's family: SD1.5's architecture at a size that trains in seconds on a CPU.

Only the facts (16-token captions, the VAE's scaling factor), the tiny configs and a calibrated VAE differ from
sd15; every behaviour is SD15Family's.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from schemas.families import FAMILY_FACTS, FamilyFacts
from stages.families.sd15 import SD15Family, tiny_vae

# log-variance of the calibrated posterior: std e^-6, so sampled latents carry the image, not the VAE's noise.
POSTERIOR_LOGVAR = -12.0


class TinyFamily(SD15Family):
    facts: ClassVar[FamilyFacts] = FAMILY_FACTS["tiny"]
    # Demo captions are a handful of words; 16 positions keep text caches and cross-attention small.
    tiny_text_length: ClassVar[int] = FAMILY_FACTS["tiny"].max_length

    def tiny_vae(self):
        """A random-init VAE calibrated the way a trained one is: a near-deterministic posterior, and (in the
        facts) the scaling factor that gives the demo's latent means unit std (measured: 1 / 0.186). With SD's
        0.18215 and a random posterior the latents' std is ~0.03 and the sampling noise 5x the image signal:
        diffusion training on that cannot learn the demo's classes in its budget."""
        vae = tiny_vae(4, self.facts)
        c = vae.config.latent_channels
        with torch.no_grad():
            vae.quant_conv.weight[c:] = 0
            vae.quant_conv.bias[c:] = POSTERIOR_LOGVAR
        return vae
