"""Static facts of each model family that configs are checked against.

The adapters in stages/families/ read these same facts, so a config check and the code that runs agree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from tuneline.schemas.families_wan import WAN_FACTS
from tuneline.schemas.family_facts import FamilyFacts

# Scaling/shift factors are the published SD/SDXL/SD3/Flux VAE values (tiny: measured on its pretrained demo VAE,
# see stages/families/tiny/adapter.py); a real model's own VAE config wins at run time.
_VAE = ("first_stage_model.", "vae.")
_SGM = "https://github.com/Stability-AI/generative-models"
FAMILY_FACTS: dict[str, FamilyFacts] = {
    "tiny": FamilyFacts(
        "tiny",
        8,
        1,
        4,
        0.6722,
        0.0,
        "epsilon",
        16,
        max_length_limit=16,
        tiny_revision="3",
        released=False,
        checkpoint_marker="cond_stage_model.transformer.",
        checkpoint_components=(("vae", _VAE), ("text_encoder", ("cond_stage_model.",))),
        single_file_export=True,
        text_encoder_lora=True,
        kohya_base_version="sd_v1",
        modelspec_arch="stable-diffusion-v1",
    ),
    "sd15": FamilyFacts(
        "sd15",
        8,
        1,
        4,
        0.18215,
        0.0,
        "epsilon",
        77,
        max_length_limit=77,
        checkpoint_marker="cond_stage_model.transformer.",
        checkpoint_components=(("vae", _VAE), ("text_encoder", ("cond_stage_model.",))),
        shipped_config="SD1.5",
        single_file_export=True,
        text_encoder_lora=True,
        kohya_base_version="sd_v1",
        modelspec_arch="stable-diffusion-v1",
        modelspec_impl=_SGM,
    ),
    "sdxl": FamilyFacts(
        "sdxl",
        8,
        1,
        4,
        0.13025,
        0.0,
        "epsilon",
        77,
        max_length_limit=77,
        pipeline="StableDiffusionXLPipeline",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        checkpoint_marker="conditioner.embedders.1.",
        checkpoint_components=(
            ("vae", _VAE),
            ("text_encoder", ("conditioner.embedders.0.",)),
            ("text_encoder_2", ("conditioner.embedders.1.",)),
        ),
        shipped_config="SDXL base 1.0",
        single_file_export=True,
        text_encoder_lora=True,
        kohya_base_version="sdxl_base_v1-0",
        modelspec_arch="stable-diffusion-xl-v1-base",
        modelspec_impl=_SGM,
    ),
    "sd3": FamilyFacts(
        "sd3",
        8,
        2,
        16,
        1.5305,
        0.0609,
        "flow_matching",
        77,
        max_length_limit=512,
        pipeline="StableDiffusion3Pipeline",
        denoiser_model="SD3Transformer2DModel",
        denoiser="transformer",
        text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),
        tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3"),
        checkpoint_marker="joint_blocks.",
        checkpoint_components=(
            ("vae", _VAE),
            ("text_encoder", ("text_encoders.clip_l.",)),
            ("text_encoder_2", ("text_encoders.clip_g.",)),
            ("text_encoder_3", ("text_encoders.t5xxl.",)),
        ),
        shipped_config="SD3 medium",
        kohya_base_version="sd3",
        modelspec_arch="stable-diffusion-3-medium",
        modelspec_impl="https://github.com/Stability-AI/sd3-ref",
    ),
    "flux": FamilyFacts(
        "flux",
        8,
        2,
        16,
        0.3611,
        0.1159,
        "flow_matching",
        512,
        max_length_limit=512,
        negative_needs_guidance=False,
        pipeline="FluxPipeline",
        denoiser_model="FluxTransformer2DModel",
        denoiser="transformer",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        checkpoint_marker="double_blocks.",
        checkpoint_components=(
            ("vae", _VAE),
            ("text_encoder", ("text_encoders.clip_l.",)),
            ("text_encoder_2", ("text_encoders.t5xxl.",)),
        ),
        shipped_config="FLUX.1-dev",
        kohya_base_version="flux1",
        modelspec_arch="flux-1-dev",
        modelspec_impl="https://github.com/black-forest-labs/flux",
    ),
    # FLUX.1 Kontext [dev]: FLUX.1 with the input image's tokens appended (image editing from paired datasets).
    "flux_kontext": FamilyFacts(
        "flux_kontext",
        8,
        2,
        16,
        0.3611,
        0.1159,
        "flow_matching",
        512,
        max_length_limit=512,
        negative_needs_guidance=False,
        pipeline="FluxKontextPipeline",
        denoiser_model="FluxTransformer2DModel",
        denoiser="transformer",
        text_encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        tiny_revision="2",
        tiny_max_length=16,
        kohya_base_version="flux1",
        modelspec_arch="flux-1-dev/kontext",
        modelspec_impl="https://huggingface.co/black-forest-labs/FLUX.1-Kontext-dev",
    ),
    # Latents are normalised per channel (the VAE config's latents_mean/std); the scalars are the identity.
    "qwen_image": FamilyFacts(
        "qwen_image",
        8,
        2,
        16,
        1.0,
        0.0,
        "flow_matching",
        512,
        max_length_limit=1024,
        tiny_revision="2",  # the tiny VAE's latent statistics measured on the demo's pictures
        negative_needs_guidance=False,
        pipeline="QwenImagePipeline",
        denoiser_model="QwenImageTransformer2DModel",
        denoiser="transformer",
        checkpoint_marker="transformer_blocks.0.img_mod.",
        shipped_config="Qwen-Image",
        kohya_base_version="qwen_image",
        modelspec_arch="qwen-image",
        modelspec_impl="https://github.com/QwenLM/Qwen-Image",
    ),
    # Qwen-Image-Edit: Qwen-Image with the input image's tokens appended and shown to its vision-language text encoder;
    # max_length makes room for the input image's vision tokens (about 1,370 at the pipeline's 1024 x 1024).
    "qwen_image_edit": FamilyFacts(
        "qwen_image_edit",
        8,
        2,
        16,
        1.0,
        0.0,
        "flow_matching",
        1536,
        max_length_limit=4096,
        tiny_revision="2",  # the tiny VAE's latent statistics measured on the demo's pictures
        tiny_input_area=64 * 64,  # the demo's image size
        tiny_max_length=48,  # the template's kept tokens and a 64 x 64 input's vision tokens: about 20-25
        negative_needs_guidance=False,
        pipeline="QwenImageEditPipeline",
        denoiser_model="QwenImageTransformer2DModel",
        denoiser="transformer",
        kohya_base_version="qwen_image_edit",
        modelspec_arch="qwen-image-edit",
        modelspec_impl="https://github.com/QwenLM/Qwen-Image",
    ),
    # Qwen-Image-Edit Plus (2509): one or several input images, each seen by the text encoder at about 384 x 384
    # (about 200 vision tokens each with the released processor) and appended as tokens at about 1024 x 1024.
    "qwen_image_edit_plus": FamilyFacts(
        "qwen_image_edit_plus",
        8,
        2,
        16,
        1.0,
        0.0,
        "flow_matching",
        1024,
        max_length_limit=4096,
        tiny_revision="2",  # the tiny VAE's latent statistics measured on the demo's pictures
        tiny_input_area=64 * 64,  # the demo's image size
        tiny_max_length=48,  # the template's kept tokens and a 64 x 64 input's vision tokens: about 20-25
        negative_needs_guidance=False,
        pipeline="QwenImageEditPlusPipeline",
        denoiser_model="QwenImageTransformer2DModel",
        denoiser="transformer",
        kohya_base_version="qwen_image_edit_plus",
        modelspec_arch="qwen-image-edit-plus",
        modelspec_impl="https://github.com/QwenLM/Qwen-Image",
    ),
    # Z-Image: Flux.1's VAE, 2x2 patches inside the transformer, Qwen3 captions of up to 512 chat-template tokens.
    "z_image": FamilyFacts(
        "z_image",
        8,
        2,
        16,
        0.3611,
        0.1159,
        "flow_matching",
        512,
        max_length_limit=512,
        pipeline="ZImagePipeline",
        denoiser_model="ZImageTransformer2DModel",
        denoiser="transformer",
        checkpoint_marker="cap_embedder.",
        shipped_config="Z-Image-Turbo",
    ),
    # FLUX.2: 32 VAE channels, 2x2 patchified into 128 and batch-norm normalised (cached that way: scale 1, shift 0).
    "flux2": FamilyFacts(
        "flux2",
        8,
        2,
        32,
        1.0,
        0.0,
        "flow_matching",
        512,
        max_length_limit=512,
        # The tiny tokenizer's FLUX.2 system message is one token, and with a demo caption the template takes about
        # 10; the positions after the caption, padding included, carry it (stages/families/flux2/adapter.py).
        tiny_revision="4",
        tiny_max_length=64,
        negative_needs_guidance=False,
        pipeline="Flux2Pipeline",
        denoiser_model="Flux2Transformer2DModel",
        denoiser="transformer",
        checkpoint_marker="double_stream_modulation_img.",
        shipped_config="FLUX.2-dev",
    ),
    "flux2_klein": FamilyFacts(
        "flux2_klein",
        8,
        2,
        32,
        1.0,
        0.0,
        "flow_matching",
        512,
        max_length_limit=512,
        tiny_revision="2",
        tiny_max_length=48,  # the chat template around a demo caption is about 30 tokens
        negative_needs_guidance=True,
        pipeline="Flux2KleinPipeline",
        denoiser_model="Flux2Transformer2DModel",
        denoiser="transformer",
        checkpoint_marker="double_stream_modulation_img.",
        shipped_config="FLUX.2-klein-4B",
    ),
    **WAN_FACTS,
}
# The type of model.family: exactly the rows above (the first row is the default, the demo's tiny flavor).
FamilyName = Literal[tuple(FAMILY_FACTS)]  # type: ignore[valid-type]
DEFAULT_FAMILY: str = next(iter(FAMILY_FACTS))
# model.config names of the weightless shipped configs (stages/families/configs/<name>/) -> their family: the
# family's own name for its main size, then its further sizes; and each one's title.
SHIPPED_CONFIGS: dict[str, str] = {n: n for n, f in FAMILY_FACTS.items() if f.shipped_config} | {
    size: n for n, f in FAMILY_FACTS.items() for size, _ in f.shipped_sizes
}
SHIPPED_TITLES: dict[str, str] = {n: f.shipped_config for n, f in FAMILY_FACTS.items() if f.shipped_config} | {
    size: title for f in FAMILY_FACTS.values() for size, title in f.shipped_sizes
}


def family_list(pick) -> str:
    """Comma-separated names of the families whose facts pass `pick` (for help texts and messages)."""
    return ", ".join(n for n, f in FAMILY_FACTS.items() if pick(f))


def facts(name: str) -> FamilyFacts:
    try:
        return FAMILY_FACTS[name]
    except KeyError:
        raise ValueError(f"model.family: unknown family {name!r}; known: {', '.join(FAMILY_FACTS)}") from None


def variant_family(family: object, config: object, path: object) -> str | None:
    """The row that `family` (a family, or a row of another layout: FamilyFacts.variant_of) trains for this model:
    a row of another layout that model.config names, or whose flag the model_index.json of model.path (or of a
    model.config folder beside a single file as model.path) sets; `family`'s variant_of when that readable
    model_index.json lacks its flag (the folder is of the main layout). None: `family` itself, also for values of
    the wrong type, which the field checks name."""
    if not all(v is None or isinstance(v, str) for v in (family, config, path)):
        return None
    variants = {n: f for n, f in FAMILY_FACTS.items() if f.variant_of == family or (n == family and f.variant_of)}
    if config in variants:
        return config
    folder = _local(path)
    beside = config if folder is not None and not _is_dir(folder) and config not in SHIPPED_CONFIGS else None
    for index in (_model_index(folder), _model_index(_local(beside))) if variants else ():
        if index is None:
            continue
        found = next((n for n, f in variants.items() if index.get(f.variant_flag)), None)
        return found or (FAMILY_FACTS[family].variant_of or None)
    return None


def _local(folder: str | None) -> Path | None:
    """A local path with ~ expanded (None: none, a URL, or an unknown user: the field checks report that)."""
    try:
        return Path(folder).expanduser() if folder and "://" not in folder else None
    except RuntimeError:
        return None


def _is_dir(folder: Path) -> bool:
    try:
        return folder.is_dir()
    except OSError:
        return False


def _model_index(folder: Path | None) -> dict | None:
    """A local diffusers folder's model_index.json (None: none, or unreadable: the folder check reports that)."""
    try:
        data = json.loads((folder / "model_index.json").read_text(encoding="utf-8")) if folder is not None else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
