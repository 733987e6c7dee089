"""Shared pieces of the kohya (sd-scripts) LoRA layouts the families map their modules to (stages/train/kohya.py
writes the file; each family's lora.py says where each of its diffusers modules lands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """Where one diffusers module's update lands: kohya module `name`, part `slot` of `parts` fused parts
    (0 of 1 when not fused); the fused layer's output rows per part come from the model's modules."""

    name: str
    slot: int = 0
    parts: tuple[str, ...] = ()  # the diffusers module paths fused into `name`, in row order


QKV = ("to_q", "to_k", "to_v")
ADD_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")


def fused(prefix: str, names: tuple[str, ...], leaf: str, name: str) -> Target:
    return Target(name, names.index(leaf), tuple(f"{prefix}.{n}" for n in names))


def lora_pairs(peft_state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers module path -> (down = lora_A, up = lora_B) from a peft state dict (`<path>.lora_A.weight`);
    anything but plain A/B pairs is refused."""
    downs = {k.removesuffix(".lora_A.weight"): v for k, v in peft_state.items() if k.endswith(".lora_A.weight")}
    ups = {k.removesuffix(".lora_B.weight"): v for k, v in peft_state.items() if k.endswith(".lora_B.weight")}
    odd = sorted(set(downs) ^ set(ups)) + sorted(
        k for k in peft_state if not k.endswith((".lora_A.weight", ".lora_B.weight"))
    )
    if odd:
        raise ValueError(f"train.lora_format kohya: adapter weights other than plain LoRA A/B pairs: {odd[:5]}")
    return {k: (downs[k], ups[k]) for k in downs}
