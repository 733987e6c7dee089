"""SDXL's original (sgm) single-file layout: the SD1.x UNet and VAE names (the SD1.x folder's single_file.py), both text
encoders under `conditioner.embedders`: `conditioner.embedders.0.transformer.*` (CLIP) and
`conditioner.embedders.1.model.*` (OpenCLIP names)."""

from __future__ import annotations

import re

import torch

from tuneline.stages.families.sd15.single_file import _clip, placed, unet_vae_state

_OPEN_CLIP = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}
_OPEN_CLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}


def _open_clip(te: torch.nn.Module, prefix: str) -> tuple[dict, list[str]]:
    """HF CLIPTextModelWithProjection -> OpenCLIP's names (SDXL's second encoder): q, k, v fused into
    `attn.in_proj_*`, the projection as a matrix applied from the right (HF's weight transposed)."""
    out, lost, qkv = {}, [], {}
    for k, v in te.state_dict().items():
        k = k.removeprefix("text_model.")
        if k.endswith("position_ids"):
            continue
        if k in _OPEN_CLIP:
            out[prefix + _OPEN_CLIP[k]] = v
            continue
        if k == "text_projection.weight":
            out[prefix + "text_projection"] = v.T.contiguous()
            continue
        m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", k)
        if not m:
            lost.append(k)
            continue
        block = f"{prefix}transformer.resblocks.{m[1]}"
        if m[2] in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            qkv.setdefault((block, m[3]), {})[m[2][-6]] = v
        elif m[2] in _OPEN_CLIP_LAYER:
            out[f"{block}.{_OPEN_CLIP_LAYER[m[2]]}.{m[3]}"] = v
        else:
            lost.append(k)
    for (block, kind), parts in qkv.items():
        out[f"{block}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out, [f"text_encoder_2.{k}" for k in lost]


def ldm_state_dict(pipe) -> dict:
    """The original-layout state dict of a SDXL pipeline (UNet, VAE, both text encoders)."""
    out, lost = unet_vae_state(pipe)
    out.update(_clip(pipe.text_encoder, "conditioner.embedders.0.transformer."))
    second, missed = _open_clip(pipe.text_encoder_2, "conditioner.embedders.1.model.")
    out.update(second)
    return placed(out, lost + missed)
