"""The flux kohya LoRA layout: the original (BFL) names, `lora_unet_double_blocks_N_img_attn_qkv`,
`..._img_attn_proj`, `lora_unet_single_blocks_N_linear1`, ... (fused layers: stages/train/kohya.py)."""

from __future__ import annotations

import re

from tuneline.stages.families.kohya_layout import ADD_QKV, QKV, Target, fused

KOHYA_LAYOUT = "flux"


def kohya_target(path: str, den) -> Target | None:
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", path)
    if m:
        i, rest, pre = m[1], m[2], f"transformer_blocks.{m[1]}"
        single = {
            "attn.to_out.0": "img_attn.proj",
            "attn.to_add_out": "txt_attn.proj",
            "ff.net.0.proj": "img_mlp.0",
            "ff.net.2": "img_mlp.2",
            "ff_context.net.0.proj": "txt_mlp.0",
            "ff_context.net.2": "txt_mlp.2",
            "norm1.linear": "img_mod.lin",
            "norm1_context.linear": "txt_mod.lin",
        }
        if rest in single:
            return Target(f"double_blocks.{i}.{single[rest]}")
        leaf = rest.removeprefix("attn.")
        if leaf in QKV:
            return fused(f"{pre}.attn", QKV, leaf, f"double_blocks.{i}.img_attn.qkv")
        if leaf in ADD_QKV:
            return fused(f"{pre}.attn", ADD_QKV, leaf, f"double_blocks.{i}.txt_attn.qkv")
        return None
    m = re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", path)
    if m:
        i, rest, pre = m[1], m[2], f"single_transformer_blocks.{m[1]}"
        if rest == "proj_out":
            return Target(f"single_blocks.{i}.linear2")
        if rest == "norm.linear":
            return Target(f"single_blocks.{i}.modulation.lin")
        # linear1 = [q; k; v; mlp input] in that row order (BFL's SingleStreamBlock).
        parts = (f"{pre}.attn.to_q", f"{pre}.attn.to_k", f"{pre}.attn.to_v", f"{pre}.proj_mlp")
        if path in parts:
            return Target(f"single_blocks.{i}.linear1", parts.index(path), parts)
    return None
