"""Black Forest Labs' original Flux transformer layout (double_blocks / single_blocks, as in flux1-dev.safetensors,
optionally under ComfyUI's "model.diffusion_model." prefix) -> diffusers' FluxTransformer2DModel names.

diffusers' own converter (single_file_utils.convert_flux_transformer_checkpoint_to_diffusers) splits each single
block's fused projection with FLUX.1's width (3072) written in, so a Flux of any other width fails in it; here the
split sizes come from the tensors' shapes, and the rest is the same renaming.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

PREFIX = "model.diffusion_model."
# (diffusers name, original name) of the embedders; ".weight" / ".bias" follow.
EMBEDDERS = (
    ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    ("context_embedder", "txt_in"),
    ("x_embedder", "img_in"),
    ("proj_out", "final_layer.linear"),
)
DOUBLE = (
    ("norm1.linear", "img_mod.lin"),
    ("norm1_context.linear", "txt_mod.lin"),
    ("ff.net.0.proj", "img_mlp.0"),
    ("ff.net.2", "img_mlp.2"),
    ("ff_context.net.0.proj", "txt_mlp.0"),
    ("ff_context.net.2", "txt_mlp.2"),
    ("attn.to_out.0", "img_attn.proj"),
    ("attn.to_add_out", "txt_attn.proj"),
)
DOUBLE_NORMS = (
    ("attn.norm_q", "img_attn.norm.query_norm"),
    ("attn.norm_k", "img_attn.norm.key_norm"),
    ("attn.norm_added_q", "txt_attn.norm.query_norm"),
    ("attn.norm_added_k", "txt_attn.norm.key_norm"),
)


def _swap(t: torch.Tensor) -> torch.Tensor:
    """BFL's final modulation is (shift, scale), diffusers' AdaLayerNormContinuous (scale, shift)."""
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def _blocks(sd: dict[str, torch.Tensor], kind: str) -> int:
    return len({k.split(".")[1] for k in sd if k.startswith(kind + ".")})


def flux_to_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The transformer's tensors of an original-layout file (other components' tensors ignored), renamed and split
    into diffusers' layout; raises KeyError naming a tensor the layout needs that the file lacks."""
    sd = {k.removeprefix(PREFIX): v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}

    def wb(new: str, old: str) -> None:
        for s in ("weight", "bias"):
            if f"{old}.{s}" in sd:
                out[f"{new}.{s}"] = sd[f"{old}.{s}"]

    def split(new: tuple[str, ...], old: str, sizes: list[int]) -> None:
        for s in ("weight", "bias"):
            for name, part in zip(new, torch.split(sd[f"{old}.{s}"], sizes, dim=0)):
                out[f"{name}.{s}"] = part

    for new, old in EMBEDDERS:
        wb(new, old)
    inner = sd["img_in.weight"].shape[0]
    for i in range(_blocks(sd, "double_blocks")):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for new, old in DOUBLE:
            wb(b + new, d + old)
        for new, old in DOUBLE_NORMS:
            out[f"{b}{new}.weight"] = sd[f"{d}{old}.scale"]
        split((b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"), d + "img_attn.qkv", [inner] * 3)
        split((b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"), d + "txt_attn.qkv", [inner] * 3)
    for i in range(_blocks(sd, "single_blocks")):
        b, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        wb(b + "norm.linear", s + "modulation.lin")
        wb(b + "proj_out", s + "linear2")
        out[f"{b}attn.norm_q.weight"] = sd[f"{s}norm.query_norm.scale"]
        out[f"{b}attn.norm_k.weight"] = sd[f"{s}norm.key_norm.scale"]
        mlp = sd[f"{s}linear1.weight"].shape[0] - 3 * inner  # the fused q, k, v and MLP input projection
        split(
            (b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"),
            s + "linear1",
            [inner, inner, inner, mlp],
        )
    for s in ("weight", "bias"):
        out[f"norm_out.linear.{s}"] = _swap(sd[f"final_layer.adaLN_modulation.1.{s}"])
    return out


def load_flux_transformer(file: Path, config_dir: Path) -> Any:
    """FluxTransformer2DModel of `config_dir`/transformer's config holding `file`'s transformer (built on the meta
    device and assigned the file's tensors, so the weights are in memory once)."""
    from diffusers import FluxTransformer2DModel
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        keys = [
            k
            for k in f.keys()
            if k.removeprefix(PREFIX).startswith(
                tuple(o for _, o in EMBEDDERS) + ("double_blocks.", "single_blocks.", "final_layer.")
            )
        ]
        state = flux_to_diffusers({k: f.get_tensor(k) for k in keys})
    with torch.device("meta"):
        config = FluxTransformer2DModel.load_config(config_dir, subfolder="transformer")
        model = FluxTransformer2DModel.from_config(config)
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=True, assign=True)
    return model
