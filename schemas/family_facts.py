"""The facts every model family is described by (schemas/families.py holds each family's row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    vae_factor: int
    patch_size: int
    latent_channels: int
    scaling_factor: float
    shift_factor: float
    prediction: Literal["epsilon", "v_prediction", "flow_matching"]
    max_length: int
    # Longest caption (tokens) the main text encoder embeds: CLIP's position table, or T5's declared 512.
    max_length_limit: int
    # Whether a negative prompt only takes effect through classifier-free guidance (guidance_scale > 1).
    # False where the pipeline applies it by other means (Flux: true CFG at its own scale).
    negative_needs_guidance: bool = True
    # Folder layout (diffusers pipeline class and component subfolders): read without loading anything.
    pipeline: str = "StableDiffusionPipeline"
    denoiser: str = "unet"
    # The denoiser's diffusers class (the pipeline's signature names it too; tests/unit/test_family_folders.py
    # checks they agree): a training process builds it by name, never importing the pipeline and its processors.
    denoiser_model: str = "UNet2DConditionModel"
    text_encoders: tuple[str, ...] = ("text_encoder",)
    tokenizers: tuple[str, ...] = ("tokenizer",)
    # Bump when the tiny flavor's configs or tokenizer change, so stale cached folders are not reused.
    tiny_revision: str = "1"
    # Caption tokens of the tiny flavor (model.path null) when text.max_length is null; 0: max_length. Short
    # captions ("make it red") padded to 512 tokens would be most of what a tiny model's joint attention sees.
    tiny_max_length: int = 0
    # Pixels the tiny flavor's edit pipelines scale an input image to, for the VAE and the text encoder alike; 0:
    # the released pipeline's own (Qwen-Image-Edit: about 1 MP whatever the output size, so a 64 x 64 demo pair
    # would train beside 4,096 control tokens).
    tiny_input_area: int = 0
    # Released checkpoints exist (single files are recognised by checkpoint_marker, a tensor-name prefix only this
    # family's original layout has; "model.diffusion_model." is looked through) and their weighted components
    # other than the denoiser, by original-layout prefix.
    released: bool = True
    checkpoint_marker: str = ""
    checkpoint_components: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A weightless config of the released model ships in stages/families/configs/<name>/ (model.config: <name>).
    shipped_config: str = ""  # its title, e.g. "SD1.5"; empty: none ships
    # Further released sizes with a weightless config (model.config name -> title), each shipped in
    # stages/families/configs/<name>/ with its shapes in the family's shipped_<name>.json.
    shipped_sizes: tuple[tuple[str, str], ...] = ()
    # The released models' usual training edge (pixels) where their VAE config names no sample_size; 0: 1024.
    usual_resolution: int = 0
    # train.export_single_file writes the whole model in the original (LDM) layout.
    single_file_export: bool = False
    # train.text_encoder_lora: the adapter declares the text encoders' LoRA targets (Family.text_encoder_lora_targets).
    text_encoder_lora: bool = False
    # LoRA file headers: kohya's ss_base_model_version and the SAI model spec's architecture and implementation.
    kohya_base_version: str = ""
    modelspec_arch: str = ""
    modelspec_impl: str = "diffusers"
    # Video families: frames per latent frame of the VAE (Wan: 4, so clips have 4k+1 frames); 0 = an image family.
    temporal_factor: int = 0
    # Video families' bucket defaults: the frame rate clips are trained at and the frame budgets.
    fps: float = 0.0
    frame_buckets: tuple[int, ...] = ()
    # Timestep experts (Wan 2.2 A14B): the pipeline components that each denoise a share of the schedule, the
    # high-noise one first, with the file suffix each one's LoRA gets; model.expert picks which train. (): one
    # denoiser, and model.expert is refused.
    experts: tuple[tuple[str, str], ...] = ()
    # The shipped folder's boundary_ratio (the timestep share of each expert, as a sigma) that config checks use;
    # training reads the folder's own.
    expert_boundary: float | None = None
    # Another layout of the family `variant_of` names: model.family <variant_of> trains this row when model.config
    # names this row (its shipped config; with model.path null, its tiny flavor), or when model.path is a diffusers
    # folder whose model_index.json sets `variant_flag` true (schemas/families.py: variant_family).
    variant_of: str = ""
    variant_flag: str = ""

    @property
    def video(self) -> bool:
        return self.temporal_factor > 0

    @property
    def alignment(self) -> int:
        """Smallest pixel multiple a bucket edge may have: one latent patch."""
        return self.vae_factor * self.patch_size
