"""Test-side writers of the original (SAI / BFL) single-file layouts of SD3 and Flux transformers from diffusers
models: the inverse of diffusers' convert_sd3_/convert_flux_transformer_checkpoint_to_diffusers, written here from
the layouts, not by calling those (the tests use them only to check that a file converts back to the model)."""

from __future__ import annotations

import torch

PREFIX = "model.diffusion_model."


def _swap(t: torch.Tensor) -> torch.Tensor:
    """The originals' final modulation is (shift, scale); diffusers' is (scale, shift). Swapping is an involution."""
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _wb(out: dict, src: dict, new: str, old: str, fn=lambda t: t) -> None:
    for s in ("weight", "bias"):
        if f"{old}.{s}" in src:
            out[f"{new}.{s}"] = fn(src[f"{old}.{s}"])


def _qkv(out: dict, src: dict, new: str, olds: tuple[str, ...]) -> None:
    for s in ("weight", "bias"):
        out[f"{new}.{s}"] = torch.cat([src[f"{o}.{s}"] for o in olds], dim=0)


def sd3_original(sd: dict[str, torch.Tensor], prefix: str = PREFIX) -> dict[str, torch.Tensor]:
    """SD3Transformer2DModel state dict -> SAI's MMDiT names (joint_blocks, x_block / context_block)."""
    out = {"pos_embed": sd["pos_embed.pos_embed"]}
    _wb(out, sd, "x_embedder.proj", "pos_embed.proj")
    _wb(out, sd, "context_embedder", "context_embedder")
    for i, name in ((0, "linear_1"), (2, "linear_2")):
        _wb(out, sd, f"t_embedder.mlp.{i}", f"time_text_embed.timestep_embedder.{name}")
        _wb(out, sd, f"y_embedder.mlp.{i}", f"time_text_embed.text_embedder.{name}")
    layers = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    for i in range(layers):
        b, j, last = f"transformer_blocks.{i}.", f"joint_blocks.{i}.", i == layers - 1
        _qkv(out, sd, j + "x_block.attn.qkv", (b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"))
        _qkv(
            out, sd, j + "context_block.attn.qkv", (b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj")
        )
        _wb(out, sd, j + "x_block.attn.proj", b + "attn.to_out.0")
        _wb(out, sd, j + "x_block.adaLN_modulation.1", b + "norm1.linear")
        # the last context block's modulation is a final-layer-style (shift, scale) pair
        _wb(
            out,
            sd,
            j + "context_block.adaLN_modulation.1",
            b + "norm1_context.linear",
            _swap if last else (lambda t: t),
        )
        _wb(out, sd, j + "x_block.mlp.fc1", b + "ff.net.0.proj")
        _wb(out, sd, j + "x_block.mlp.fc2", b + "ff.net.2")
        if not last:  # the last context block only feeds the image stream (context_pre_only)
            _wb(out, sd, j + "context_block.attn.proj", b + "attn.to_add_out")
            _wb(out, sd, j + "context_block.mlp.fc1", b + "ff_context.net.0.proj")
            _wb(out, sd, j + "context_block.mlp.fc2", b + "ff_context.net.2")
    _wb(out, sd, "final_layer.linear", "proj_out")
    _wb(out, sd, "final_layer.adaLN_modulation.1", "norm_out.linear", _swap)
    return {prefix + k: v for k, v in out.items()}


def flux_original(sd: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """FluxTransformer2DModel state dict -> BFL's names (double_blocks / single_blocks; no prefix, as in
    flux1-dev.safetensors)."""
    out: dict[str, torch.Tensor] = {}
    for old, new in (
        ("timestep_embedder", "time_in"),
        ("text_embedder", "vector_in"),
        ("guidance_embedder", "guidance_in"),
    ):
        _wb(out, sd, f"{new}.in_layer", f"time_text_embed.{old}.linear_1")
        _wb(out, sd, f"{new}.out_layer", f"time_text_embed.{old}.linear_2")
    _wb(out, sd, "txt_in", "context_embedder")
    _wb(out, sd, "img_in", "x_embedder")
    double = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks."))
    for i in range(double):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        _wb(out, sd, d + "img_mod.lin", b + "norm1.linear")
        _wb(out, sd, d + "txt_mod.lin", b + "norm1_context.linear")
        _qkv(out, sd, d + "img_attn.qkv", (b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"))
        _qkv(out, sd, d + "txt_attn.qkv", (b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"))
        for side, q, k in (("img", "norm_q", "norm_k"), ("txt", "norm_added_q", "norm_added_k")):
            out[d + f"{side}_attn.norm.query_norm.scale"] = sd[b + f"attn.{q}.weight"]
            out[d + f"{side}_attn.norm.key_norm.scale"] = sd[b + f"attn.{k}.weight"]
        _wb(out, sd, d + "img_mlp.0", b + "ff.net.0.proj")
        _wb(out, sd, d + "img_mlp.2", b + "ff.net.2")
        _wb(out, sd, d + "txt_mlp.0", b + "ff_context.net.0.proj")
        _wb(out, sd, d + "txt_mlp.2", b + "ff_context.net.2")
        _wb(out, sd, d + "img_attn.proj", b + "attn.to_out.0")
        _wb(out, sd, d + "txt_attn.proj", b + "attn.to_add_out")
    single = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("single_transformer_blocks."))
    for i in range(single):
        b, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        _wb(out, sd, s + "modulation.lin", b + "norm.linear")
        _qkv(out, sd, s + "linear1", (b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"))
        out[s + "norm.query_norm.scale"] = sd[b + "attn.norm_q.weight"]
        out[s + "norm.key_norm.scale"] = sd[b + "attn.norm_k.weight"]
        _wb(out, sd, s + "linear2", b + "proj_out")
    _wb(out, sd, "final_layer.linear", "proj_out")
    _wb(out, sd, "final_layer.adaLN_modulation.1", "norm_out.linear", _swap)
    return {prefix + k: v for k, v in out.items()}
