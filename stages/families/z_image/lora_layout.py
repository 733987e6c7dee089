"""The ComfyUI LoRA layout of Z-Image.

ComfyUI loads Z-Image as its Lumina2 model; `comfy/lora.py` maps LoRA keys `diffusion_model.<diffusers path>`
(also `transformer.`, `lycoris_`) for every module that `comfy/utils.py: z_image_to_diffusers` lists: in the main
layers and both refiners, the attention projections (q/k/v into its fused qkv, to_out.0), the feed-forward w1-w3 and
the adaLN modulation. Keys are kohya-style `<stem>.lora_down.weight`, `<stem>.lora_up.weight`, `<stem>.alpha`,
which ComfyUI's LoRA adapter reads; q, k and v stay separate (ComfyUI slices each into the fused weight)."""
from __future__ import annotations

import re

import torch

PREFIX = "diffusion_model."
MAPPED = re.compile(r"^(layers|context_refiner|noise_refiner)\.\d+\."
                    r"(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|adaLN_modulation\.0)$")


def lora_pairs(peft_state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path -> (down = lora_A, up = lora_B); anything but plain A/B pairs is refused."""
    downs = {k.removesuffix(".lora_A.weight"): v for k, v in peft_state.items() if k.endswith(".lora_A.weight")}
    ups = {k.removesuffix(".lora_B.weight"): v for k, v in peft_state.items() if k.endswith(".lora_B.weight")}
    odd = sorted(set(downs) ^ set(ups)) + sorted(k for k in peft_state if not k.endswith((".lora_A.weight",
                                                                                            ".lora_B.weight")))
    if odd:
        raise ValueError(f"train.lora_format kohya: adapter weights other than plain LoRA A/B pairs: {odd[:5]}")
    return {k: (downs[k], ups[k]) for k in downs}


def comfy_state(peft_state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The ComfyUI file's tensors for a peft state dict (`<path>.lora_A.weight` / `.lora_B.weight`). Raises naming
    trained modules ComfyUI has no key for, so the file never silently drops part of the training."""
    mods = lora_pairs(peft_state)
    unmapped = sorted(p for p in mods if not MAPPED.match(p))
    if unmapped:
        raise ValueError(f"train.lora_format kohya: ComfyUI maps no Z-Image key for trained module(s) {unmapped[:5]}; "
                         f"set train.lora_format diffusers or train.lora_targets to attention/feed-forward layers")
    out: dict[str, torch.Tensor] = {}
    for path, (down, up) in sorted(mods.items()):
        stem = PREFIX + path
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
        out[f"{stem}.alpha"] = torch.tensor(float(alpha))
    return out
