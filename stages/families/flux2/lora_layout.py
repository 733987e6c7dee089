"""The ComfyUI LoRA layout of FLUX.2: ComfyUI's Flux2 model is a Flux, so `comfy/lora.py` maps keys
`transformer.<diffusers path>` (also `lora_transformer_`, `lycoris_`, bare) for each module `comfy/utils.py:
flux_to_diffusers` lists: double blocks' attention (to_q/k/v and add_q/k/v_proj into the fused qkv, to_out.0,
to_add_out) and feed-forwards (linear_in/linear_out), single blocks' fused to_qkv_mlp_proj and to_out."""

from __future__ import annotations

import re

import torch

from tuneline.stages.families.comfy_lora import comfy_state

PREFIX = "transformer."
MAPPED = re.compile(
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|"
    r"to_add_out)|ff\.linear_(in|out)|ff_context\.linear_(in|out))|"
    r"single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))$"
)


def flux2_comfy_state(peft_state: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    return comfy_state(peft_state, alpha, PREFIX, MAPPED, "FLUX.2")
