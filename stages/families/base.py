"""The one interface every model family implements. Generic code calls these; it never tests a family name.

A family is one folder, stages/families/<name>/ (see stages/families/README.md): adapter.py (this interface),
optional parts the generic code finds through registry.family_part: lora.py (KOHYA_LAYOUT, the layout's name, and
kohya_target(path, denoiser) -> kohya_layout.Target | None: where a trained diffusers module lands in the kohya
file), and anything else only the family uses (latent packing, single-file layout). Its pure-data facts are its row
in schemas/families.py; shipped.json holds the released model's tensor shapes its shipped config describes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from tuneline.schemas.families import FamilyFacts

# How load_denoiser puts each denoiser component on the device as it is built (None: `.to(device)`).
Place = Callable[[torch.nn.Module], torch.nn.Module] | None


def scale_latents(x: torch.Tensor, scaling: float | torch.Tensor, shift: float | torch.Tensor) -> torch.Tensor:
    """Cached latents are the VAE's raw distribution; the denoiser sees (z - shift) * scale (training, and the
    validate stage comparing renders with cached latents). Per-channel factors are (C, 1, 1) tensors
    (latent_affine), moved to x's device and dtype."""
    if isinstance(scaling, torch.Tensor):
        scaling, shift = scaling.to(x.device, x.dtype), shift.to(x.device, x.dtype)
    return (x - shift) * scaling


def latent_affine(manifest: Any) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(scaling, shift) for scale_latents from a latents manifest. With per-channel statistics (a VAE normalised
    as ((z - mean) / std - shift) * scaling) they are (C, 1, 1) tensors: scaling / std and mean + shift * std."""
    mean, std = getattr(manifest, "latents_mean", None), getattr(manifest, "latents_std", None)
    if mean is None or std is None:
        return manifest.scaling_factor, manifest.shift_factor
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return manifest.scaling_factor / s, m + manifest.shift_factor * s


@dataclass
class TextEncoders:
    """Tokenizers + encoders of one family, loaded once and passed back to the adapter."""

    tokenizers: list[Any]
    encoders: list[torch.nn.Module]
    max_length: int
    extra: dict[str, Any] = field(default_factory=dict)
    # Pixels an edit family's pipeline scales its input images to (resolve.input_area); None: the pipeline's own.
    input_area: int | None = None


@dataclass(frozen=True)
class MicroCond:
    """Per-sample size facts recorded by the scan (SDXL micro-conditioning reads them; others ignore them)."""

    original_size: tuple[int, int]  # (height, width)
    crop_top_left: tuple[int, int]  # (top, left) in bucket pixels
    target_size: tuple[int, int]  # (height, width)


class Family(Protocol):
    """Every member is present on every family: optional abilities have their default in
    common.DiffusersFamily, and generic code reads them as attributes (tests/unit/test_family_protocol.py refuses
    getattr/hasattr probing of a family)."""

    facts: FamilyFacts
    # The folder layout (from facts) and the denoiser's class (from the pipeline's signature).
    pipeline_class: type
    denoiser_component: str
    text_components: tuple[str, ...]
    tokenizer_components: tuple[str, ...]
    denoiser_class: type

    # Model folders ---------------------------------------------------------------------------
    def ensure_model(
        self,
        path: str | None,
        cache_dir: Path,
        config: str | None = None,
        text_encoder_path: str | None = None,
        vae_path: str | None = None,
        expert: str | None = None,
    ) -> Path:
        """A diffusers folder for this family: `path` (folder, or a single checkpoint converted once into
        `cache_dir`, its configs from the diffusers folder `config` when given), or for None the family's tiny random-init flavor built deterministically in `cache_dir`.
        `expert` (model.expert) says which timestep experts' files a run of split files needs.
        Raises ValueError naming the missing component / file."""

    def denoiser_files(self, file: Path, config: Path, expert: str | None) -> dict[str, Path]:
        """Denoiser component -> the file its weights come from, for a transformer file given as model.path over the
        diffusers folder `config` (split files); a family of timestep experts maps each expert to its file, with a
        ValueError naming the fix where one is missing or does not fit."""

    def single_file_denoiser(self, file: Path, config: Path) -> Any | None:
        """The denoiser of an original-layout .safetensors file when the family reads that layout itself (configs
        from the diffusers folder `config`); None: diffusers' from_single_file converts it."""

    def identity(self, model_dir: Path, component: str) -> str:
        """Stable hash of a component's config + weights ('vae', 'text', 'denoiser')."""

    def check_folder(self, folder: Path) -> None:
        """ValueError naming what a diffusers folder of this family lacks."""

    # Released checkpoints split into files (stages/families/split_files.py): component -> the diffusers class
    # whose single-file converter reads that component's file, where it is not the component's own class.
    single_file_layouts: dict[str, str]

    # Latents ---------------------------------------------------------------------------------
    def load_vae(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module: ...

    def load_vae_encoder(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """What caching needs of the VAE: `encode(x).latent_dist` (mean, std), `dtype` and `config`."""

    def vae_factors(self, vae: torch.nn.Module) -> tuple[float, float]:
        """(scaling_factor, shift_factor) from the VAE's own config, facts as fallback."""

    def latent_stats(self, vae: torch.nn.Module) -> tuple[list[float], list[float]] | None:
        """Per-channel (mean, std) the pipeline normalises latents with before scaling_factor/shift_factor, or
        None (scalars only). The latents manifest records them."""

    # Text ------------------------------------------------------------------------------------
    def load_text_encoders(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, max_length: int | None = None
    ) -> TextEncoders: ...

    def encode_text(self, enc: TextEncoders, captions: list[str]) -> dict[str, torch.Tensor]:
        """Every tensor the denoiser and the pipeline need for these captions, batch first
        (e.g. prompt_embeds, pooled_prompt_embeds, attention masks). A family whose text encoder sees the control
        images (text_sees_control) takes them as a third argument, one per caption."""

    def check_max_length(self, tokenizers: list[Any], max_length: int) -> None:
        """ValueError when captions of `max_length` tokens exceed what the family's text encoder embeds."""

    # Tensors encode_text returns that the pipeline takes as `<key>=` / `negative_<key>=`.
    prompt_keys: tuple[str, ...]

    # Training --------------------------------------------------------------------------------
    def load_denoiser(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, expert: str | None = None, place: Place = None
    ) -> torch.nn.Module:
        """The denoiser training holds; `expert` (model.expert) picks the timestep experts of a family that has
        them (facts.experts; the config refuses it for the others). `place` puts each denoiser component on
        `device` as it is built (default `.to(device)`; a quantized base is quantized on the way), so no more than
        one component's host copy exists at a time."""

    def build_denoiser(
        self, model_dir: Path, expert: str | None, build: Callable[[str], torch.nn.Module]
    ) -> torch.nn.Module:
        """The denoiser load_denoiser returns, around `build(component)` for each denoiser component model.expert
        `expert` holds: the same structure with other weights (FSDP's skeleton and its gathered copy)."""

    def denoiser_parts(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The pipeline components a training denoiser holds, by component name: the denoiser itself, or the
        timestep experts it trains (each gets its own LoRA files, named by facts.experts)."""

    def sigma_range(self, denoiser: torch.nn.Module) -> tuple[float, float]:
        """The noise levels (sigma, [lo, hi)) training draws for this denoiser: all, or one expert's share."""

    def sigma_splits(self, denoiser: torch.nn.Module) -> tuple[float, ...]:
        """The sigmas where this denoiser hands over from one timestep expert it holds to the next (none: one
        denoiser); each training step draws on one side, the same on every rank (SigmaSampler.step_share)."""

    def lora_load_kwargs(self, component: str) -> dict[str, Any]:
        """load_lora_weights' arguments that put a LoRA file into the pipeline component `component` (an expert
        other than the denoiser's own component)."""

    def load_noise_scheduler(self, model_dir: Path) -> Any: ...

    def denoise(
        self,
        denoiser: torch.nn.Module,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        text: dict[str, torch.Tensor],
        micro: list[MicroCond] | None = None,
    ) -> torch.Tensor:
        """The denoiser's prediction for scaled latents `noisy` (B, C, H, W) = (z - shift) * scale, returned in
        the same shape (the adapter packs/unpacks tokens itself). The target kind is facts.prediction.
        Timesteps: epsilon/v families take the DDPM schedule's integer steps in [0, 1000); flow-matching families
        take a float tensor in [0, 1000) with sigma = t / 1000, noisy = (1 - sigma) * x0 + sigma * noise and
        target = noise - x0 (the adapter converts to its model's own timestep convention)."""

    # The denoiser's modules a LoRA trains (peft suffixes; stages/families/README.md says why, per family).
    lora_target_modules: tuple[str, ...]
    # train.text_encoder_lora: the text encoders' modules its LoRA targets (peft suffixes); empty where the family
    # has none (its schemas/families.py row says text_encoder_lora, which the config check reads).
    text_encoder_lora_targets: tuple[str, ...]

    def unused_modules(self, model: torch.nn.Module, component: str) -> tuple[str, ...]:
        """Modules of `model`, the pipeline component `component` (the denoiser's or a text encoder's), whose output
        never reaches the training loss: e.g. the last block's text stream of a transformer that keeps only the image
        tokens. No adapter targets them and a full fine-tune keeps them frozen: a trained parameter without a gradient
        stops DDP at its second step ("Expected to have finished reduction"). Default: none."""

    def block_stacks(self, model: torch.nn.Module) -> tuple[str, ...]:
        """Paths of the denoiser's stacks of repeated blocks (torch ModuleLists), in call order: what block swap
        moves between host and GPU one block at a time (stages/train/swap.py), and what sharding splits."""

    def check_full_finetune(self, model_dir: Path, shards: int = 1) -> None:
        """ValueError before a full fine-tune loads a denoiser whose training state does not fit one GPU when
        split `shards` ways (DDP: 1, every process holds it all); stages/families/full_limit.py."""

    def comfy_lora_state(
        self, denoiser: torch.nn.Module, peft_state: dict[str, torch.Tensor], alpha: float
    ) -> dict[str, torch.Tensor] | None:
        """The ComfyUI-loadable LoRA file (lora_kohya.safetensors) of a family whose layout is not one of
        stages/train/kohya.py's; None: kohya.to_kohya writes it from the family's lora.py."""

    def single_file_state(self, pipe: Any) -> dict[str, torch.Tensor]:
        """train.export_single_file: the whole pipeline's tensors in the original layout (facts.single_file_export
        says which families have one; the others raise ValueError)."""

    def save_pipeline(self, model_dir: Path, denoiser: torch.nn.Module, out_dir: Path) -> None:
        """Write a folder `DiffusionPipeline.from_pretrained(out_dir)` loads: the base components + `denoiser`."""

    # Validation ------------------------------------------------------------------------------
    def load_pipeline(
        self, model_dir: Path, dtype: torch.dtype, device: torch.device, denoiser: torch.nn.Module | None = None
    ) -> Any: ...

    def text_encoders_of(self, pipe: Any, max_length: int | None = None) -> TextEncoders: ...

    def prompt_kwargs(self, text: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """Keyword arguments for the pipeline call from pre-encoded prompt and negative prompt (batch 1 each,
        both from encode_text). A None/empty negative is left to the pipeline. Pass an encoded negative (e.g. of
        "") whenever text.max_length differs from the tokenizer's own length, so both have the same length."""

    # True where the pipeline, given pre-encoded prompts, needs negative embeds too (the renderer then encodes "",
    # as the pipeline would itself).
    negative_required: bool

    # Edit families (paired datasets: dataset.control) -----------------------------------------
    # The training loop puts the batch's scaled control latents in `cond["control_latents"]` for `denoise`.
    takes_control: bool
    # The text stage caches rows per (instruction, control image) and calls encode_text(enc, captions, images).
    text_sees_control: bool
    # Several reference images per target (<control>/<stem>/*.png).
    multiple_references: bool
    # The pipeline shares one call's input images between its prompts: each sample renders in a call of its own.
    one_control_per_call: bool

    def control_size(self, width: int, height: int, area: int | None = None) -> tuple[int, int]:
        """The pixel size the latents stage caches a control of a (width, height) bucket at (default: the
        bucket's; Qwen-Image-Edit's pipelines encode inputs at about 1 MP whatever the output size, or at `area`
        pixels where the run sets one: resolve.input_area)."""

    def control_kwargs(self, images: list[Any] | None, width: int, height: int) -> dict[str, Any]:
        """The pipeline's input-image arguments for one render call (default: none)."""

    def edit_call(
        self, pipe: Any, enc: TextEncoders, kwargs: dict[str, Any], prompts: list[str], negatives: list[str]
    ) -> tuple[Any, dict[str, Any]]:
        """The pipeline and arguments of one render call (default: unchanged; Qwen-Image-Edit encodes the prompts
        with the input images)."""

    # Video families ----------------------------------------------------------------------------
    # Extra arguments of every render call (a video pipeline's frame count).
    render_kwargs: dict[str, Any]

    def rendered(self, output: Any) -> Any:
        """The pictures of a pipeline call's output, one per prompt (default: `output.images`; a video pipeline's
        clips' first frames)."""

    def rendered_latents(self, latents: torch.Tensor, width: int, height: int, vae: Any) -> torch.Tensor:
        """The pipeline's output_type="latent" result as (B, C, H, W) cache-space latents (the edit learning check
        compares them with the cache); `vae` is the render's VAE (a family whose pipeline undoes the cache's normalisation
        redoes it with the VAE's statistics); default: already in that shape."""
