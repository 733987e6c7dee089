"""Scan stage: the bucketing config (how images and clips are sized and grouped into buckets)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tuneline.schemas.base import Seed, Strict


class BucketConfig(Strict):
    resolution: float = Field(
        64,
        gt=0,
        description="pixel: shorter edge in px; area: megapixels (1.0 = 1024x1024); "
        "pixel_area: edge whose square is the target area",
    )
    resolution_type: Literal["pixel", "area", "pixel_area"] = "pixel"
    alignment: int | None = Field(
        None,
        ge=1,
        description="bucket edges are multiples of this; null = the family's "
        "requirement (VAE factor x patch size). Must be a multiple of it.",
    )
    min_aspect: float = Field(0.25, gt=0, description="width/height below this is clamped (cropped)")
    max_aspect: float = Field(4.0, gt=0, description="width/height above this is clamped (cropped)")
    upscale: bool = Field(True, description="allow images smaller than the target to be upscaled to it")
    min_edge: int = Field(0, ge=0, description="reject images whose shorter edge (px, after EXIF rotation) is below")
    crop: Literal["center", "random", "corner"] = "center"
    seed: Seed = 0
    small_bucket: Literal["repeat", "drop"] = Field(
        "repeat",
        description="a bucket with fewer images than one global batch (train.batch_size x "
        "train.processes x gradient accumulation): repeat its images to fill a batch, or drop "
        "it (its images are listed in rejected.jsonl)",
    )

    fps: float | None = Field(
        None, gt=0, description="video families: the frame rate clips are trained at; null = the family's (Wan: 16)"
    )
    frames: list[int] | None = Field(
        None,
        min_length=1,
        description="video families: the frame budgets of the buckets (each obeying the family's frame rule, Wan: "
        "4k+1); a clip takes the largest that fits it; null = the family's ([17, 33, 49, 81] for Wan)",
    )
    clip: Literal["start", "center", "every"] = Field(
        default="start",
        description="video families: which part of a clip longer than its bucket is trained: its start, its "
        "center, or every consecutive part (one record per part, each with its time range)",
    )
    resolutions: list[float] | None = Field(
        None,
        min_length=1,
        description="multi-resolution training: every "
        "image is bucketed and cached at each of these (same unit as "
        "`resolution`, which must be among them); null = `resolution` only",
    )

    @model_validator(mode="after")
    def _aspects(self) -> BucketConfig:
        if self.min_aspect > self.max_aspect:
            raise ValueError(
                f"buckets.min_aspect ({self.min_aspect}) must be <= buckets.max_aspect ({self.max_aspect})"
            )
        if self.frames is not None and (min(self.frames) < 1 or len(set(self.frames)) != len(self.frames)):
            raise ValueError(f"buckets.frames {self.frames} must be distinct frame counts >= 1")
        if self.resolutions is not None:
            if self.resolution not in self.resolutions:
                raise ValueError(
                    f"buckets.resolutions {self.resolutions} must include buckets.resolution {self.resolution}"
                )
            if any(r <= 0 for r in self.resolutions) or len(set(self.resolutions)) != len(self.resolutions):
                raise ValueError(f"buckets.resolutions {self.resolutions} must be distinct and > 0")
        return self

    def all_resolutions(self) -> list[float]:
        return sorted(self.resolutions) if self.resolutions else [self.resolution]
