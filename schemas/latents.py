"""Latent cache stage: config and manifest."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.base import Manifest, Strict


class LatentsConfig(Strict):
    batch_size: int = Field(8, ge=1, description="images per VAE forward (always within one bucket)")
    dtype: Literal["float16", "float32"] = Field("float16", description="stored dtype (Zarr has no bfloat16)")
    flip: bool = Field(False, description="also cache the horizontally flipped variant")
    workers: int = Field(2, ge=0, description="decode/resize worker threads overlapping the VAE")


class LatentBucket(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(description="bucket width in pixels")
    height: int
    shape: tuple[int, int, int] = Field(description="latent (C, H, W) of one image")
    count: int
    array: str = Field(description="Zarr group path inside the artifact")


class LatentsManifest(Manifest):
    stage: Literal["latents"] = "latents"
    family: str
    vae_identity: str
    vae_factor: int
    latent_channels: int
    scaling_factor: float
    shift_factor: float
    dtype: str
    store: str = "latents.zarr"
    buckets: list[LatentBucket]
    count: int
    rejected: int = 0
