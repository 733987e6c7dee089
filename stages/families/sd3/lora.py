"""The sd3 kohya LoRA layout: the original (MMDiT) names, `lora_unet_joint_blocks_N_x_block_attn_qkv`,
`..._x_block_attn_proj`, ... (fused layers: stages/train/kohya.py)."""

from __future__ import annotations

import re

from tuneline.stages.families.kohya_layout import ADD_QKV, QKV, Target, fused

KOHYA_LAYOUT = "mmdit"


def kohya_target(path: str, den) -> Target | None:
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(attn2?)\.(.+)", path)
    if m:
        i, attn, leaf = m[1], m[2], m[3]
        pre = f"transformer_blocks.{i}.{attn}"
        if leaf in QKV:
            return fused(pre, QKV, leaf, f"joint_blocks.{i}.x_block.{attn}.qkv")
        if leaf == "to_out.0":
            return Target(f"joint_blocks.{i}.x_block.{attn}.proj")
        if attn == "attn" and leaf in ADD_QKV:
            return fused(pre, ADD_QKV, leaf, f"joint_blocks.{i}.context_block.attn.qkv")
        if attn == "attn" and leaf == "to_add_out":
            return Target(f"joint_blocks.{i}.context_block.attn.proj")
        return None
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(ff|ff_context)\.net\.(0\.proj|2)", path)
    if m:
        block = "x_block" if m[2] == "ff" else "context_block"
        return Target(f"joint_blocks.{m[1]}.{block}.mlp.{'fc1' if m[3] == '0.proj' else 'fc2'}")
    return None
