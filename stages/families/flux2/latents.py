"""FLUX.2's latent space: the VAE's 32 channels, patchified 2x2 into 128 and normalised per channel by the VAE's
batch-norm running statistics (Flux2Pipeline applies them after patchifying), then packed into tokens.

The cache holds that normalised space laid out back as (32, H/8, W/8) (unpatchified), so the shared stages see a
plain (C, H, W) latent with scale 1 and shift 0 whose noise is i.i.d. like the pipeline's: patchifying is a
permutation, so Gaussian noise there is Gaussian noise here, and a loss mask at H/8 still lines up.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch


def patchify(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2), channel order as Flux2Pipeline._patchify_latents."""
    b, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"FLUX.2 latents need even height and width, got {h}x{w} (bucket alignment must be 16 px)")
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """Inverse of patchify (Flux2Pipeline._unpatchify_latents)."""
    b, c, h, w = x.shape
    return x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) patchified -> (B, H*W, C) tokens, row-major (Flux2Pipeline._pack_latents)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, h, w)


def latent_ids(b: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(B, H*W, 4) positions (t=0, row, column, l=0) of the packed tokens (Flux2Pipeline._prepare_latent_ids)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    return ids.unsqueeze(0).expand(b, -1, -1).to(device)


def text_ids(b: int, length: int, device: torch.device) -> torch.Tensor:
    """(B, L, 4) positions (0, 0, 0, token index) of the caption tokens (Flux2Pipeline._prepare_text_ids)."""
    ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length))
    return ids.unsqueeze(0).expand(b, -1, -1).to(device)


def bn_stats(vae: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) per patchified channel, shaped (1, 4C, 1, 1), as the pipeline computes them."""
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


class NormalisedEncoder(torch.nn.Module):
    """What the latents stage needs of a VAE (`encode(x).latent_dist` with mean and std, `dtype`, `config`), in
    FLUX.2's normalised space: mean' = unpatchify((patchify(mean) - bn_mean) / bn_std), std' likewise scaled."""

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    @property
    def config(self):
        return self.vae.config

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        dist = self.vae.encode(x).latent_dist
        m, s = bn_stats(self.vae)
        m, s = m.to(dist.mean), s.to(dist.mean)
        mean = unpatchify((patchify(dist.mean) - m) / s)
        std = unpatchify(patchify(dist.std) / s)
        return SimpleNamespace(latent_dist=SimpleNamespace(mean=mean, std=std))
