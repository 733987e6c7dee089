"""FLUX.2 reference images (dataset.control): each reference's normalised latents are patchified and packed into
tokens appended after the generated image's, with position ids (10 + 10 i, row, column, 0) for reference i, as
Flux2Pipeline.prepare_image_latents / _prepare_image_ids build them from `image=`; the generated image's tokens have
time coordinate 0. The transformer predicts for every token; only the generated image's prediction is used.

The cached control latents are already the pipeline's normalised space (latents.py), at the target's size: the
latents stage resizes each reference to its target's size, and validation hands the pipeline references at the
render size, so training and rendering see the same token grid.
"""

from __future__ import annotations

import torch

from tuneline.stages.families.flux2 import latents as lat

T_SCALE = 10  # Flux2Pipeline._prepare_image_ids' default `scale`: reference i sits at time 10 + 10 i


def reference_ids(b: int, index: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    """(B, h*w, 4) position ids of reference `index`'s packed tokens (h, w: the patchified grid)."""
    t = torch.tensor([T_SCALE + T_SCALE * index])
    ids = torch.cartesian_prod(t, torch.arange(h), torch.arange(w), torch.arange(1))
    return ids.unsqueeze(0).expand(b, -1, -1).to(device)


def as_references(control: torch.Tensor) -> torch.Tensor:
    """(B, N, C, H, W) from one reference per target (B, C, H, W) or several (B, N, C, H, W)."""
    if control.dim() == 4:
        return control.unsqueeze(1)
    if control.dim() != 5:
        raise ValueError(f"control latents must be (B, C, H, W) or (B, N, C, H, W), got {tuple(control.shape)}")
    return control


def reference_tokens(control: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, N*h*w, 4C), ids (B, N*h*w, 4)) of the references, in order, for targets shaped like `like`."""
    refs = as_references(control).to(like.device, like.dtype)
    b, n, *shape = refs.shape
    if tuple(shape) != tuple(like.shape[1:]) or b != like.shape[0]:
        raise ValueError(f"control latents {tuple(refs.shape)} do not match the targets {tuple(like.shape)}")
    h, w = shape[1] // 2, shape[2] // 2
    tokens = [lat.pack(lat.patchify(refs[:, i])) for i in range(n)]
    ids = [reference_ids(b, i, h, w, like.device) for i in range(n)]
    return torch.cat(tokens, dim=1), torch.cat(ids, dim=1)
