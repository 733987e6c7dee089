"""The original (LDM) single-file layout of SD1.x, which SDXL's shares for its UNet and VAE: the layout A1111,
Forge and ComfyUI's checkpoint loaders read and model sites distribute. `model.diffusion_model.*` (UNet),
`first_stage_model.*` (VAE), `cond_stage_model.transformer.*` (SD1.x's CLIP text encoder).

The names are the original Stable Diffusion modules': UNet levels flattened into `input_blocks` / `middle_block` /
`output_blocks` (each a (resnet, attention) or a down/upsampler), resnets' `in_layers`/`emb_layers`/`out_layers`,
the VAE's `down`/`up` levels (the decoder's numbered from the bottom) and its attention as 1x1 convolutions.
"""

from __future__ import annotations

import re

import torch

_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def _resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESNET.get(head, head)}.{tail}"


def unet_name(key: str, per: int) -> str | None:
    """diffusers UNet2DConditionModel key -> original UNet key (without `model.diffusion_model.`)."""
    fixed = {
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "conv_in": "input_blocks.0.0",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
        "add_embedding.linear_1": "label_emb.0.0",
        "add_embedding.linear_2": "label_emb.0.2",
    }
    mod, _, param = key.rpartition(".")
    if mod in fixed:
        return f"{fixed[mod]}.{param}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        idx = 1 + int(m[1]) * (per + 1) + int(m[3])
        return f"input_blocks.{idx}.0.{_resnet(m[4])}" if m[2] == "resnets" else f"input_blocks.{idx}.1.{m[4]}"
    m = re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.+)", key)
    if m:
        return f"input_blocks.{(int(m[1]) + 1) * (per + 1)}.0.op.{m[2]}"
    m = re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        if m[1] == "attentions":
            return f"middle_block.1.{m[3]}"
        return f"middle_block.{2 * int(m[2])}.{_resnet(m[3])}"
    m = re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key)
    if m:
        idx = int(m[1]) * (per + 1) + int(m[3])
        return f"output_blocks.{idx}.0.{_resnet(m[4])}" if m[2] == "resnets" else f"output_blocks.{idx}.1.{m[4]}"
    return None


def _upsampler(key: str, per: int, has_attention: set[int]) -> str | None:
    m = re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.+)", key)
    if not m:
        return None
    i = int(m[1])
    # The upsampler follows the level's last (resnet[, attention]) layer in the same output block.
    return f"output_blocks.{i * (per + 1) + per}.{2 if i in has_attention else 1}.conv.{m[2]}"


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_name(key: str, levels: int) -> str | None:
    """diffusers AutoencoderKL key -> original VAE key (without `first_stage_model.`)."""
    m = re.fullmatch(r"(encoder|decoder)\.(.+)", key)
    if not m:
        return key if key.startswith(("quant_conv.", "post_quant_conv.")) else None
    side, rest = m[1], m[2]
    rest = rest.replace("conv_norm_out.", "norm_out.")
    r = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.+)", rest)
    if r:
        level = int(r[2]) if r[1] == "down" else levels - 1 - int(r[2])  # the decoder counts from the bottom
        if r[3] == "resnets":
            return f"{side}.{r[1]}.{level}.block.{r[4]}.{r[5].replace('conv_shortcut', 'nin_shortcut')}"
        return f"{side}.{r[1]}.{level}.{'downsample' if r[1] == 'down' else 'upsample'}.{r[5]}"
    r = re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", rest)
    if r:
        return f"{side}.mid.block_{int(r[1]) + 1}.{r[2]}"
    r = re.fullmatch(r"mid_block\.attentions\.0\.(.+)\.(weight|bias)", rest)
    if r and r[1] in _VAE_ATTN:
        return f"{side}.mid.attn_1.{_VAE_ATTN[r[1]]}.{r[2]}"
    if rest.split(".")[0] in ("conv_in", "conv_out", "norm_out"):
        return f"{side}.{rest}"
    return None


def _clip(te: torch.nn.Module, prefix: str) -> dict:
    """HF CLIP text encoder -> the original's `<prefix>text_model.*` (HF's own names under the wrapper)."""
    return {
        f"{prefix}text_model.{k.removeprefix('text_model.')}": v
        for k, v in te.state_dict().items()
        if not k.endswith("position_ids")
    }


def unet_vae_state(pipe) -> tuple[dict, list[str]]:
    """(original-layout UNet and VAE tensors, the diffusers names it cannot place) of a SD1.x/SDXL pipeline."""
    unet, vae = pipe.unet, pipe.vae
    per = unet.config.layers_per_block
    if not isinstance(per, int):
        raise ValueError(
            "train.export_single_file: the UNet's layers_per_block varies per level; the original "
            "layout needs one value (set train.export_single_file false)"
        )
    has_attention = {i for i, t in enumerate(unet.config.up_block_types) if "CrossAttn" in t}
    out, lost = {}, []
    for k, v in unet.state_dict().items():
        name = unet_name(k, per) or _upsampler(k, per, has_attention)
        (lost.append(f"unet.{k}") if name is None else out.__setitem__(f"model.diffusion_model.{name}", v))
    levels = len(vae.config.block_out_channels)
    for k, v in vae.state_dict().items():
        name = vae_name(k, levels)
        if name is None:
            lost.append(f"vae.{k}")
            continue
        if ".mid.attn_1." in name and name.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # the original VAE's attention projections are 1x1 convolutions
        out[f"first_stage_model.{name}"] = v
    return out, lost


def placed(out: dict, lost: list[str]) -> dict:
    """`out`, or ValueError naming the weights without an original-layout name (the file never silently lacks part
    of the model)."""
    if lost:
        raise ValueError(
            f"train.export_single_file: no original-layout name for {lost[:8]}"
            f"{' …' if len(lost) > 8 else ''}; set train.export_single_file false"
        )
    return out


def ldm_state_dict(pipe) -> dict:
    """The original-layout state dict of a SD1.x pipeline (UNet, VAE, CLIP text encoder)."""
    out, lost = unet_vae_state(pipe)
    out.update(_clip(pipe.text_encoder, "cond_stage_model.transformer."))
    return placed(out, lost)
