"""LoRA files in the layout ComfyUI's `comfy/lora.py` maps for transformer families that it addresses by their
diffusers module names (Z-Image as Lumina2, FLUX.2 as Flux): `<prefix><diffusers path>` with kohya-style tensors
`<stem>.lora_down.weight`, `<stem>.lora_up.weight`, `<stem>.alpha`, which ComfyUI's LoRA adapter reads. Fused
weights (q, k, v into one qkv) stay separate here: ComfyUI slices each part into the fused weight itself."""

from __future__ import annotations

import re

import torch

from tuneline.stages.families.kohya_layout import lora_pairs


def comfy_state(
    peft_state: dict[str, torch.Tensor], alpha: float, prefix: str, mapped: re.Pattern, family: str
) -> dict[str, torch.Tensor]:
    """The ComfyUI file's tensors. Raises naming trained modules ComfyUI has no key for (`mapped` lists the
    diffusers paths it maps), so the file never silently drops part of the training."""
    mods = lora_pairs(peft_state)
    unmapped = sorted(p for p in mods if not mapped.match(p))
    if unmapped:
        raise ValueError(
            f"train.lora_format kohya: ComfyUI maps no {family} key for trained module(s) "
            f"{unmapped[:5]}; set train.lora_format diffusers"
        )
    out: dict[str, torch.Tensor] = {}
    for path, (down, up) in sorted(mods.items()):
        stem = prefix + path
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(float(alpha))
    return out
