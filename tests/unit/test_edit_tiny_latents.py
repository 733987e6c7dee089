"""The edit families' tiny flavors train on latents that carry the picture: in the space the denoiser sees (after the
family's scale and shift or normalisation), the demo's pictures are about unit-wide and each pair of demo colors
lies a clear fraction of the noise apart. With the released statistics on random-init VAEs the colors were about a
hundredth of the noise apart and the edit demo learned nothing (bench/README.md, learning.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tuneline.schemas.families import FAMILY_FACTS
from tuneline.stages.families.flux2 import latents as flux2_latents
from tuneline.stages.families.flux2.adapter import tiny_vae as flux2_tiny_vae
from tuneline.stages.families.registry import get_family
from tuneline.stages.families.tiny.adapter import demo_pictures


def _flux_kontext(x: torch.Tensor) -> torch.Tensor:
    vae = get_family("flux_kontext").tiny_vae()
    return (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor


def _flux2(name: str):
    def encode(x: torch.Tensor) -> torch.Tensor:
        return flux2_latents.NormalisedEncoder(flux2_tiny_vae(FAMILY_FACTS[name])).encode(x).latent_dist.mean

    return encode


def _qwen(name: str):
    def encode(x: torch.Tensor) -> torch.Tensor:
        family = get_family(name)
        _, vae = family.tiny_denoiser_and_vae(32)
        mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in family.latent_stats(vae))
        return (vae.encode(x.unsqueeze(2)).latent_dist.mean.squeeze(2) - mean) / std

    return encode


ENCODERS = {
    "flux_kontext": _flux_kontext,
    "flux2": _flux2("flux2"),
    "flux2_klein": _flux2("flux2_klein"),
    "qwen_image_edit": _qwen("qwen_image_edit"),
    "qwen_image_edit_plus": _qwen("qwen_image_edit_plus"),
}


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_denoiser_space_is_unit_wide_and_tells_the_demo_colors_apart(name):
    torch.manual_seed(0)
    with torch.no_grad():
        z = ENCODERS[name](demo_pictures()).float()
    assert 0.7 < z.std().item() < 1.4, z.std().item()
    apart = min((z[i] - z[j]).abs().mean().item() for i, j in itertools.combinations(range(len(z)), 2))
    assert apart > 0.15, apart


def test_klein_rendered_latents_are_in_the_cache_space():
    """Flux2KleinPipeline's output_type="latent" result is in the VAE's raw scale (what vae.decode takes); the edit
    check compares it with cached, normalised latents, so the family's hook must give back the cache's own encoding
    of the same picture. Taken as is, the raw latents lie well away from it (the tiny VAE's statistics are measured,
    away from (0, 1))."""
    vae = flux2_tiny_vae(FAMILY_FACTS["flux2_klein"])
    x = demo_pictures()[:4]
    with torch.no_grad():
        raw = vae.encode(x).latent_dist.mean
        cached = flux2_latents.NormalisedEncoder(vae).encode(x).latent_dist.mean
        got = get_family("flux2_klein").rendered_latents(raw, x.shape[-1], x.shape[-2], vae)
    assert (raw - cached).abs().max() > 0.1
    torch.testing.assert_close(got, cached, rtol=1e-4, atol=1e-4)
