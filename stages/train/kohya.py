"""The kohya (sd-scripts) LoRA layout that ComfyUI, A1111 and Forge load, from our diffusers/peft adapter weights.

Each kohya module is `lora_unet_<module path with '_' for '.'>` with `.lora_down.weight`, `.lora_up.weight` and
`.alpha` (the effective scale is alpha / rank, rank = lora_down's rows). The module path is the one kohya's own
trainers write for each family:

- sd15 (and tiny): the diffusers UNet's names (sd-scripts trains SD1.x on a UNet with diffusers' names), e.g.
  `lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q`.
- sdxl: the original (sgm/LDM) UNet's names (sd-scripts trains SDXL on the original UNet), e.g.
  `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`.
- flux: the original (BFL) names, `lora_unet_double_blocks_N_img_attn_qkv`, `..._img_attn_proj`,
  `lora_unet_single_blocks_N_linear1`, ...
- sd3: the original (MMDiT) names, `lora_unet_joint_blocks_N_x_block_attn_qkv`, `..._x_block_attn_proj`, ...
  ComfyUI maps `lora_unet_` + any original checkpoint module name to that module, so this loads there.

The original flux/sd3 checkpoints hold q, k and v (and single blocks' MLP input) as ONE fused linear layer where
diffusers has separate ones. A fused module's LoRA is stacked: lora_down = the parts' downs one above the other,
lora_up = block-diagonal (each part's up in its rows and its own columns, zeros elsewhere), so up @ down is exactly
each part's update in its own rows; the rank grows to k * r, so alpha grows by k to keep alpha / rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# Which layout each family's kohya file uses (keyed by family name: the layout is a fact of the architecture).
LAYOUTS = {"sd15": "unet", "tiny": "unet", "sdxl": "sgm", "flux": "flux", "sd3": "mmdit"}


@dataclass(frozen=True)
class Target:
    """Where one diffusers module's update lands: kohya module `name`, part `slot` of `parts` fused parts
    (0 of 1 when not fused); the fused layer's output rows per part come from the model's modules."""

    name: str
    slot: int = 0
    parts: tuple[str, ...] = ()  # the diffusers module paths fused into `name`, in row order


def _unet(path: str, den) -> Target:
    return Target(path)


def _sgm(path: str, den) -> Target | None:
    """diffusers UNet path -> original SDXL UNet path. input_blocks.0 is conv_in, then each down level has
    layers_per_block (resnet, attention) layers and a downsampler; up levels have one layer more and no
    separate upsampler index; the middle block is (resnet, attention, resnet)."""
    per = den.config.layers_per_block
    if not isinstance(per, int):
        return None
    m = re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", path)
    if m:
        return Target(f"input_blocks.{1 + int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}")
    m = re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.+)", path)
    if m:
        return Target(f"output_blocks.{int(m[1]) * (per + 1) + int(m[2])}.1.{m[3]}")
    m = re.fullmatch(r"mid_block\.attentions\.0\.(.+)", path)
    if m:
        return Target(f"middle_block.1.{m[1]}")
    return None


_QKV = ("to_q", "to_k", "to_v")
_ADD_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")


def _fused(prefix: str, names: tuple[str, ...], leaf: str, name: str) -> Target:
    return Target(name, names.index(leaf), tuple(f"{prefix}.{n}" for n in names))


def _flux(path: str, den) -> Target | None:
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", path)
    if m:
        i, rest, pre = m[1], m[2], f"transformer_blocks.{m[1]}"
        single = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
                  "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
                  "ff_context.net.2": "txt_mlp.2", "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin"}
        if rest in single:
            return Target(f"double_blocks.{i}.{single[rest]}")
        leaf = rest.removeprefix("attn.")
        if leaf in _QKV:
            return _fused(f"{pre}.attn", _QKV, leaf, f"double_blocks.{i}.img_attn.qkv")
        if leaf in _ADD_QKV:
            return _fused(f"{pre}.attn", _ADD_QKV, leaf, f"double_blocks.{i}.txt_attn.qkv")
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


def _mmdit(path: str, den) -> Target | None:
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(attn2?)\.(.+)", path)
    if m:
        i, attn, leaf = m[1], m[2], m[3]
        pre = f"transformer_blocks.{i}.{attn}"
        if leaf in _QKV:
            return _fused(pre, _QKV, leaf, f"joint_blocks.{i}.x_block.{attn}.qkv")
        if leaf == "to_out.0":
            return Target(f"joint_blocks.{i}.x_block.{attn}.proj")
        if attn == "attn" and leaf in _ADD_QKV:
            return _fused(pre, _ADD_QKV, leaf, f"joint_blocks.{i}.context_block.attn.qkv")
        if attn == "attn" and leaf == "to_add_out":
            return Target(f"joint_blocks.{i}.context_block.attn.proj")
        return None
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(ff|ff_context)\.net\.(0\.proj|2)", path)
    if m:
        block = "x_block" if m[2] == "ff" else "context_block"
        return Target(f"joint_blocks.{m[1]}.{block}.mlp.{'fc1' if m[3] == '0.proj' else 'fc2'}")
    return None


_MAPPERS = {"unet": _unet, "sgm": _sgm, "flux": _flux, "mmdit": _mmdit}


def kohya_name(module: str) -> str:
    """The kohya key stem for an original-layout module path."""
    return "lora_unet_" + module.replace(".", "_")


def layout(family: str) -> str:
    if family not in LAYOUTS:
        raise ValueError(f"train.lora_format kohya: no kohya layout is known for model.family {family!r} "
                         f"(known: {', '.join(sorted(LAYOUTS))}); set train.lora_format diffusers")
    return LAYOUTS[family]


def target(family: str, path: str, den: torch.nn.Module) -> Target | None:
    """Where the diffusers module `path` of denoiser `den` lands in the kohya layout, or None if nowhere."""
    return _MAPPERS[layout(family)](path, den)


def adapter_modules(peft_state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """diffusers module path -> (lora_A = down, lora_B = up) from a peft state dict (`<path>.lora_A.weight`)."""
    downs = {k.removesuffix(".lora_A.weight"): v for k, v in peft_state.items() if k.endswith(".lora_A.weight")}
    ups = {k.removesuffix(".lora_B.weight"): v for k, v in peft_state.items() if k.endswith(".lora_B.weight")}
    odd = sorted(set(downs) ^ set(ups)) + sorted(k for k in peft_state if not k.endswith(("lora_A.weight",
                                                                                            "lora_B.weight")))
    if odd:
        raise ValueError(f"train.lora_format kohya: adapter weights other than plain LoRA A/B pairs: {odd[:5]}")
    return {k: (downs[k], ups[k]) for k in downs}


def to_kohya(family: str, den: torch.nn.Module, peft_state: dict[str, torch.Tensor],
             alpha: float) -> dict[str, torch.Tensor]:
    """The kohya state dict for these adapter weights (scale alpha / rank, as peft applies it). Raises naming every
    trained module that has no place in the layout, so a file never silently drops part of the training."""
    mods = adapter_modules(peft_state)
    modules = dict(den.named_modules())
    targets = {p: target(family, p, den) for p in mods}
    missing = sorted(p for p, tg in targets.items() if tg is None)
    if missing:
        raise ValueError(f"train.lora_format kohya: no kohya name for trained module(s) {missing} of model.family "
                         f"{family}; set train.lora_format diffusers")
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, Target] = {}
    for path, tg in targets.items():
        down, up = mods[path]
        if not tg.parts:
            stem = kohya_name(tg.name)
            out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
            out[f"{stem}.alpha"] = torch.tensor(float(alpha))
        else:
            fused[tg.name] = tg
    for name, tg in fused.items():
        rows = [modules[p].out_features if p in modules else 0 for p in tg.parts]
        trained = [(s, p) for s, p in enumerate(tg.parts) if p in mods]
        down = torch.cat([mods[p][0] for _, p in trained], dim=0)
        rank = mods[trained[0][1]][0].shape[0]
        up = torch.zeros(sum(rows), rank * len(trained), dtype=down.dtype)
        for col, (slot, p) in enumerate(trained):
            top = sum(rows[:slot])
            up[top:top + rows[slot], col * rank:(col + 1) * rank] = mods[p][1]
        stem = kohya_name(name)
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down.contiguous(), up
        out[f"{stem}.alpha"] = torch.tensor(float(alpha) * len(trained))
    return out
