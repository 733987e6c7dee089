"""Test helpers: a diffusers transformer's weights written as the files ComfyUI distributes (`diffusion_models/`
files: original key names under `model.diffusion_model.`, optionally scaled fp8). The key maps are the inverses
of diffusers' single-file converters for these classes (diffusers.loaders.single_file_utils)."""

from __future__ import annotations

import re

import torch

PREFIX = "model.diffusion_model."


def qwen_image(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's Qwen-Image model uses diffusers' module names."""
    return dict(sd)


def z_image(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Z-Image's original layout (ComfyUI's Lumina2 model): fused qkv, `out`, `q_norm`/`k_norm`."""
    out, qkv = {}, {}
    for k, v in sd.items():
        m = re.match(r"(.*\.attention)\.to_([qkv])\.weight$", k)
        if m:
            qkv.setdefault(m[1], {})[m[2]] = v
            continue
        for new, old in (
            ("all_final_layer.2-1.", "final_layer."),
            ("all_x_embedder.2-1.", "x_embedder."),
            (".attention.to_out.0.", ".attention.out."),
            (".attention.norm_k.", ".attention.k_norm."),
            (".attention.norm_q.", ".attention.q_norm."),
        ):
            k = k.replace(new, old)
        out[k] = v
    for stem, parts in qkv.items():
        out[f"{stem}.qkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


_FLUX2_RENAMES = (
    ("x_embedder", "img_in"),
    ("context_embedder", "txt_in"),
    ("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    ("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    ("single_stream_modulation.linear", "single_stream_modulation.lin"),
    ("proj_out", "final_layer.linear"),
)
_FLUX2_DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.to_out.0": "img_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_add_out": "txt_attn.proj",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
_FLUX2_SINGLE = {
    "attn.to_qkv_mlp_proj": "linear1",
    "attn.to_out": "linear2",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def wan(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan's original layout (ComfyUI's WAN21 model) for the blocks' linear layers: self_attn/cross_attn q, k, v, o
    and ffn.0, ffn.2 (the rest of the model is not needed for LoRA stems)."""
    from tuneline.stages.families.wan.lora import ORIGINAL

    out = {}
    for k, v in sd.items():
        m = re.match(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$", k)
        if m and m[2] in ORIGINAL:
            out[f"blocks.{m[1]}.{ORIGINAL[m[2]]}.{m[3]}"] = v
    return out


# diffusers' module names -> Wan's original ones, applied in order: the inverse of the T2V renames in diffusers'
# convert_wan_transformer_to_diffusers (norm2 and norm3 trade places: a placeholder keeps them apart).
_WAN_TRANSFORMER = (
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    ("proj_out", "head.head"),
    ("norm2", "norm__placeholder"),
    ("norm3", "norm2"),
    ("norm__placeholder", "norm3"),
)


def wan_transformer(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A WanTransformer3DModel's weights in Wan's original layout (ComfyUI's `diffusion_models/` Wan 2.1 files)."""
    out = {}
    for k, v in sd.items():
        for new, old in _WAN_TRANSFORMER:
            k = k.replace(new, old)
        k = "head.modulation" if k == "scale_shift_table" else k.replace(".scale_shift_table", ".modulation")
        out[k] = v
    return out


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a])


def flux2(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FLUX.2's original (BFL) layout, which ComfyUI's Flux2 model reads."""
    out, qkv = {}, {}
    for k, v in sd.items():
        m = re.match(r"transformer_blocks\.(\d+)\.(.*)$", k)
        s = re.match(r"single_transformer_blocks\.(\d+)\.(.*)$", k)
        if m:
            q = re.match(r"attn\.(to_|add_)([qkv])(_proj)?\.(weight|bias)$", m[2])
            if q:
                side = "img" if q[1] == "to_" else "txt"
                qkv.setdefault(f"double_blocks.{m[1]}.{side}_attn.qkv.{q[4]}", {})[q[2]] = v
                continue
            out[f"double_blocks.{m[1]}.{_mapped(_FLUX2_DOUBLE, m[2])}"] = v
        elif s:
            out[f"single_blocks.{s[1]}.{_mapped(_FLUX2_SINGLE, s[2])}"] = v
        elif k.startswith("norm_out.linear."):
            out[k.replace("norm_out.linear.", "final_layer.adaLN_modulation.1.")] = _swap_halves(v)
        else:
            for new, old in _FLUX2_RENAMES:
                k = k.replace(new, old)
            out[k] = v
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def _mapped(table: dict[str, str], rest: str) -> str:
    if rest in table:
        return table[rest]
    stem, param = rest.rsplit(".", 1)
    return f"{table[stem]}.{param}"


def scaled_fp8(sd: dict[str, torch.Tensor], prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """ComfyUI's (old) scaled fp8 file: every 2-D weight as float8_e4m3fn over a per-tensor float32
    `scale_weight` (absmax / 448), an input scale of 1, and the `scaled_fp8` marker; the rest unchanged."""
    out = {f"{prefix}scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2:
            scale = (v.abs().max().float() / 448.0).clamp(min=1e-12)
            stem = prefix + k.removesuffix(".weight")
            out[f"{stem}.weight"] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[f"{stem}.scale_weight"] = scale.reshape(())
            out[f"{stem}.scale_input"] = torch.ones(())
        else:
            out[prefix + k] = v
    return out


def dequantized(sd: dict[str, torch.Tensor], prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """What a scaled_fp8 file holds, as float32 weights under the original names (the expected load)."""
    out = {}
    for k, v in sd.items():
        if not k.startswith(prefix) or k.endswith(("scaled_fp8", ".scale_weight", ".scale_input")):
            continue
        scale = sd.get(k.removesuffix(".weight") + ".scale_weight") if k.endswith(".weight") else None
        out[k.removeprefix(prefix)] = v.float() * scale if scale is not None else v
    return out


_WAN_RES = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
            "conv2": "residual.6", "conv_shortcut": "shortcut"}  # fmt: skip


def _wan_res(rest: str) -> str:
    for new, old in _WAN_RES.items():
        if rest.startswith(new + ".") or rest == new:
            return old + rest[len(new) :]
    return rest


def wan_vae(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Wan-structured VAE (AutoencoderKLQwenImage / AutoencoderKLWan, 2 resnets per level) in Wan's original layout,
    as ComfyUI's qwen_image_vae.safetensors: the inverse of diffusers' convert_wan_vae_to_diffusers."""
    out = {}
    for k, v in sd.items():
        side, _, rest = k.partition(".")
        if k.startswith(("quant_conv.", "post_quant_conv.")):
            name = ("conv1." if k.startswith("quant") else "conv2.") + k.split(".", 1)[1]
        elif rest.startswith("conv_in."):
            name = f"{side}.conv1.{rest[len('conv_in.') :]}"
        elif rest.startswith(("norm_out.", "conv_out.")):
            name = f"{side}.head.{'0' if rest.startswith('norm') else '2'}.{rest.split('.', 1)[1]}"
        elif m := re.match(r"mid_block\.resnets\.(\d)\.(.*)", rest):
            name = f"{side}.middle.{2 * int(m[1])}.{_wan_res(m[2])}"
        elif m := re.match(r"mid_block\.attentions\.0\.(.*)", rest):
            name = f"{side}.middle.1.{m[1]}"
        elif m := re.match(r"down_blocks\.(\d+)\.(.*)", rest):
            name = f"encoder.downsamples.{m[1]}.{_wan_res(m[2])}"
        elif m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
            block = 4 * int(m[1]) + int(m[2])
            name = f"decoder.upsamples.{block}.{_wan_res(m[3])}"
        elif m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
            name = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        else:
            raise KeyError(k)
        out[name] = v
    return out
