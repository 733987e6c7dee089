"""LoRA files in the layout ComfyUI's `comfy/lora.py` maps for transformer families that it addresses by their
diffusers module names (Z-Image as Lumina2, FLUX.2 as Flux): `<prefix><diffusers path>` with kohya-style tensors
`<stem>.lora_down.weight`, `<stem>.lora_up.weight`, `<stem>.alpha`, which ComfyUI's LoRA adapter reads. Fused
weights (q, k, v into one qkv) stay separate here: ComfyUI slices each part into the fused weight itself."""

from __future__ import annotations

import re

import torch


def lora_pairs(peft_state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (down = lora_A, up = lora_B); anything but plain A/B pairs is refused."""
    downs = {k.removesuffix(".lora_A.weight"): v for k, v in peft_state.items() if k.endswith(".lora_A.weight")}
    ups = {k.removesuffix(".lora_B.weight"): v for k, v in peft_state.items() if k.endswith(".lora_B.weight")}
    odd = sorted(set(downs) ^ set(ups)) + sorted(
        k for k in peft_state if not k.endswith((".lora_A.weight", ".lora_B.weight"))
    )
    if odd:
        raise ValueError(f"train.lora_format kohya: adapter weights other than plain LoRA A/B pairs: {odd[:5]}")
    return {k: (downs[k], ups[k]) for k in downs}


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
