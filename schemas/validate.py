"""Validation stage: prompts, rendering settings, manifest."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneline.schemas.base import ConfigPath, Manifest, Seed, Strict

# Diffusion schedulers are trained on 1000 timesteps: more sampler steps than that only repeat them, and 1e9
# steps render for years. Guidance past 100 saturates every pixel.
MAX_SAMPLER_STEPS = 1000
MAX_GUIDANCE = 100.0
MAX_CHECK_SEEDS = 256


class ValidationPrompt(Strict):
    prompt: str
    negative_prompt: str = ""
    seed: Seed = 0


class ValidationControl(Strict):
    """An edit to render: the input image and the instruction (families that take a control image)."""

    image: Annotated[str, ConfigPath()] = Field(
        description="the input image, or a folder of reference images (name order) for a family that takes "
        "several (FLUX.2); relative paths resolve against the workdir"
    )
    prompt: str = Field(description="the edit instruction")
    seed: Seed = 0


class ValidateConfig(Strict):
    prompts: list[ValidationPrompt] = Field(default_factory=lambda: [ValidationPrompt(prompt="a photo")], min_length=1)
    resolution: float | None = Field(None, gt=0, description="null = buckets.resolution")
    resolution_type: Literal["pixel", "area", "pixel_area"] | None = Field(None, description="null = buckets'")
    aspect: float = Field(1.0, ge=1 / 16, le=16, description="width/height of rendered images")
    steps: int = Field(20, ge=1, le=MAX_SAMPLER_STEPS, description="sampler steps")
    frames: int | None = Field(
        None,
        ge=1,
        le=257,
        description="video families: frames of each validation clip (4k+1 for Wan), written as MP4 and animated "
        "WebP; null = the shortest buckets.frames budget; 1 renders stills; image families ignore it",
    )
    guidance_scale: float = Field(4.0, ge=0, le=MAX_GUIDANCE)
    controls: list[ValidationControl] | None = Field(
        None,
        description="families that take a control image (image editing): the edits rendered, each {image, prompt}; "
        "null = the first N training pairs' controls with their captions (N = the number of prompts)",
    )
    learning_check: bool = Field(
        False,
        description="demo only: measure class separation in latent space and whether renders show the prompted color "
        "(the edit demo: the instructed color; the video demo: the prompted direction of motion)",
    )
    check_seeds: int = Field(4, ge=1, le=MAX_CHECK_SEEDS, description="seeds per class for the learning check")
    check_steps: int = Field(
        10,
        ge=1,
        le=MAX_SAMPLER_STEPS,
        description="sampler steps for the learning check (it compares latent "
        "channel means, which settle in fewer steps than a picture)",
    )


class RenderedImage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str
    prompt: str
    negative_prompt: str
    seed: int
    width: int
    height: int
    # A video family's validation clip: `file` is its animated WebP (shown inline), `clip` the MP4 beside it.
    frames: int | None = None
    clip: str | None = None


class ValidateManifest(Manifest):
    stage: Literal["validate"] = "validate"
    images: list[RenderedImage]
    grid: str
    class_separation_accuracy: float | None = None
    untrained_class_separation_accuracy: float | None = None
    # The demo's pixel-space check: share of check renders whose dominant non-background color is the prompted one.
    color_accuracy: float | None = None
    untrained_color_accuracy: float | None = None
    prompts_encoded_by: str = Field(
        "base text encoders",
        description="what encoded the prompts: the base model's text encoders (through the prompt cache), or "
        "the trained text encoders of a train.text_encoder_lora run (live, no cache)",
    )
    # The edit demo's check: share of edits of new controls whose result is nearest the instructed color's mean latent.
    edit_color_accuracy: float | None = None
    untrained_edit_color_accuracy: float | None = None
    controls: list[str] = Field(default_factory=list, description="per image: its control image's file, if an edit")
    # The video demo's check: share of new clips whose nearest direction mean (cached clips) is the prompted one.
    motion_accuracy: float | None = None
    untrained_motion_accuracy: float | None = None
