"""Test helpers: the LoRA key stems ComfyUI maps for each family's model, rebuilt here as `comfy/lora.py` builds
its key map (`model_lora_keys_unet`, `model_lora_keys_clip`): every adapter (LoRA, LoKr, LoHa, DoRA) is loaded
for any stem in that map, so a file with a stem outside it loses part of the training in ComfyUI.

- every model: `lora_unet_<original key with _>` and `diffusion_model.<original key>` for each weight of its
  original-layout state dict (the layouts of tests/integration/comfy_layout.py and original_layout.py);
- plus the diffusers-name forms its model class maps: UNets `lora_unet_`/`lycoris_` + any diffusers path; SD3
  `transformer.`/`lora_transformer_`/`lycoris_`; Flux and FLUX.2 the same for the modules `flux_to_diffusers`
  lists; Qwen-Image its diffusers names bare, `transformer.`, `lycoris_`; Z-Image (Lumina2) `diffusion_model.`,
  `transformer.`, `lycoris_` for the modules `z_image_to_diffusers` lists; Wan its original names only;
- CLIP text encoders: `lora_te_`/`lora_te1_` (CLIP-L) and `lora_te2_` (SDXL's CLIP-G) + the layer's path.
"""

from __future__ import annotations

import re

import torch

from tests.integration import comfy_layout, original_layout
from tuneline.stages.families.sd15.single_file import unet_name

CLIP_LAYER = ("mlp.fc1", "mlp.fc2", "self_attn.k_proj", "self_attn.q_proj", "self_attn.v_proj", "self_attn.out_proj")
Z_IMAGE_MODULES = re.compile(
    r"^(layers|context_refiner|noise_refiner)\.\d+\."
    r"(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123]|adaLN_modulation\.0)$"
)
FLUX2_MODULES = re.compile(
    r"^(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj|to_out\.0|to_add_out)|"
    r"ff\.linear_(in|out)|ff_context\.linear_(in|out))|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))$"
)
FLUX_MODULES = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.\d+\..+$")


def _weights(den: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The denoiser's base weights under their own names (an adapter's `base_layer` looked through)."""
    sd = {k.replace(".base_layer.", "."): v for k, v in den.state_dict().items()}
    return {k: v for k, v in sd.items() if not re.search(r"\.(lora_|lokr_|hada_)|lora_magnitude", k)}


def _unet_original(sd: dict, den) -> dict:
    per = den.config.layers_per_block
    per = per if isinstance(per, int) else per[0]
    return {name: v for k, v in sd.items() if (name := unet_name(k, per))}


ORIGINAL = {
    "UNet2DConditionModel": _unet_original,
    "SD3Transformer2DModel": lambda sd, den: original_layout.sd3_original(sd, prefix=""),
    "FluxTransformer2DModel": lambda sd, den: original_layout.flux_original(sd),
    "QwenImageTransformer2DModel": lambda sd, den: comfy_layout.qwen_image(sd),
    "ZImageTransformer2DModel": lambda sd, den: comfy_layout.z_image(sd),
    "Flux2Transformer2DModel": lambda sd, den: comfy_layout.flux2(sd),
    "WanTransformer3DModel": lambda sd, den: comfy_layout.wan(sd),
}
# (prefixes of the diffusers path as is, prefixes of the path with "_", which paths) per model class
DIFFUSERS_NAMES = {
    "UNet2DConditionModel": ((), ("lora_unet_", "lycoris_"), re.compile(".")),
    "SD3Transformer2DModel": (("transformer.",), ("lora_transformer_", "lycoris_"), re.compile(".")),
    "FluxTransformer2DModel": (("transformer.",), ("lora_transformer_", "lycoris_"), FLUX_MODULES),
    "QwenImageTransformer2DModel": (("", "transformer."), ("lycoris_",), re.compile(".")),
    "ZImageTransformer2DModel": (("diffusion_model.", "transformer."), ("lycoris_",), Z_IMAGE_MODULES),
    "Flux2Transformer2DModel": (("transformer.",), ("lora_transformer_", "lycoris_"), FLUX2_MODULES),
    # WAN21: its original names (the `diffusion_model.` and `lora_unet_` forms every model has).
    "WanTransformer3DModel": ((), (), re.compile("^$")),
}


def unet_stems(den: torch.nn.Module) -> set[str]:
    """The stems ComfyUI maps onto the denoiser `den` (a diffusers model, adapters looked through)."""
    cls = type(den).__name__
    sd = _weights(den)
    original = [k.removesuffix(".weight") for k in ORIGINAL[cls](sd, den) if k.endswith(".weight")]
    stems = {f"lora_unet_{k.replace('.', '_')}" for k in original} | {f"diffusion_model.{k}" for k in original}
    plain, underscored, which = DIFFUSERS_NAMES[cls]
    paths = [k.removesuffix(".weight") for k in sd if k.endswith(".weight")]
    paths = [p for p in paths if which.search(p)]
    stems |= {pre + p for pre in plain for p in paths}
    return stems | {pre + p.replace(".", "_") for pre in underscored for p in paths}


def clip_stems(layers: list[int]) -> set[str]:
    """CLIP text encoders' stems: `layers` = each encoder's layer count, in the pipeline's order."""
    prefixes = [("lora_te", "lora_te1"), ("lora_te2",)]
    return {
        f"{pre}_text_model_encoder_layers_{b}_{c.replace('.', '_')}"
        for i, n in enumerate(layers)
        for pre in prefixes[i]
        for b in range(n)
        for c in CLIP_LAYER
    }


def stems(keys) -> set[str]:
    """The module stems of a LoRA file's keys (`<stem>.lora_down.weight`, `<stem>.alpha`, `<stem>.lokr_w1`...)."""
    return {re.sub(r"\.(lora_(down|up)\.weight|alpha|dora_scale|lokr_\w+|hada_\w+)$", "", k) for k in keys}
