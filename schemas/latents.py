"""Latent cache stage: config and manifest."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tuneline.schemas.base import MAX_BATCH, Manifest, Strict


class LatentsConfig(Strict):
    batch_size: int = Field(
        8,
        ge=1,
        le=MAX_BATCH,
        description="images per VAE forward (always within one bucket); does not "
        "change the cache, so it is not part of its version",
    )
    dtype: Literal["float16", "float32"] = Field("float16", description="stored dtype (Zarr has no bfloat16)")
    flip: bool = Field(False, description="also cache the horizontally flipped variant of every image")
    workers: int = Field(
        2, ge=1, le=1024, description="decode/resize worker threads overlapping the VAE; does not change the cache"
    )
    block_rows: int = Field(
        64,
        ge=1,
        le=4096,
        description="rows per block: the unit of writing, resuming and "
        "reading (one Zarr chunk per array); larger blocks read faster and cost more memory "
        "in the training reader",
    )
    shards: int = Field(
        1,
        ge=1,
        le=1024,
        description="processes that encode at once, each its own single process "
        "(its own GPU: CUDA_VISIBLE_DEVICES per shard, or a worker of ops.shard_pool), each owning "
        "a fixed part of the blocks to encode; the cache is byte-identical to a 1-shard build, so "
        "it is not part of its version",
    )


class LatentBucket(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = Field(description="bucket width in pixels")
    height: int
    shape: tuple[int, int, int] = Field(
        description="latent (C, H, W) of one image; a clip's (C, T*h, w): its T latent frames stacked along H"
    )
    frames: int | None = Field(None, description="video families: the bucket's frames per clip")
    count: int = Field(description="rows (= cached images) in this bucket's arrays")
    array: str = Field(description="Zarr group path inside the artifact")


class ShardReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int = Field(description="shard number, 0-based")
    blocks: int = Field(description="blocks this shard owned")
    encoded: int = Field(description="rows (latents) or strings (text) it ran through the encoder")
    seconds: float = Field(description="wall time of its process")
    peak_rss: int = Field(description="peak resident memory of its process, bytes")


class LatentsManifest(Manifest):
    stage: Literal["latents"] = "latents"
    family: str
    vae_identity: str = Field(description="hash of the VAE's config + weights")
    vae_dtype: str = Field(description="dtype the VAE ran in")
    vae_factor: int
    latent_channels: int
    scaling_factor: float = Field(description="the denoiser sees (latent - shift_factor) * scaling_factor")
    shift_factor: float
    # Optional (older manifests have none): with them the denoiser sees ((latent - mean) / std - shift) * scaling.
    latents_mean: list[float] | None = Field(
        None, description="per-channel mean the VAE's latents are normalised with (e.g. Qwen-Image), null: none"
    )
    latents_std: list[float] | None = Field(None, description="per-channel std, with latents_mean")
    dtype: str = Field(description="stored dtype of mean and std")
    flip: bool = Field(description="flip_mean / flip_std arrays hold the horizontally flipped images")
    block_rows: int = Field(description="rows per block = per Zarr chunk")
    size_policy: dict = Field(
        description="resolution, unit, alignment, aspect limits, upscale, crop that made "
        "the buckets (the scan recorded the resulting sizes and crops)"
    )
    store: str = "latents.zarr"
    buckets: list[LatentBucket]
    count: int
    rejected: int = 0
    encoded: int = Field(0, description="images run through the VAE by this build")
    reused: int = Field(
        0, description="rows copied from the previous version (same image bytes, bucket, crop, VAE identity, dtypes)"
    )
    resumed: int = Field(0, description="rows kept from finished blocks of an interrupted build")
    masked: int = Field(
        0,
        description="rows with a loss mask; when > 0, masks/<bucket>.npy holds every row's mask "
        "at the latent grid (dataset.masks)",
    )
    controls: int = Field(
        0,
        description="rows with a control image (dataset.control); when > 0, controls/<bucket>.npy holds every "
        "row's control latents (VAE mean) in row order",
    )
    control_shapes: dict[str, list[int]] | None = Field(
        None,
        description="per bucket, the control latents' (C, h, w) where the family encodes its input at a size of "
        "its own (Qwen-Image-Edit: about 1 MP); null = the targets' shapes",
    )
    controls_encoded: int = Field(0, description="control images run through the VAE by this build")
    controls_reused: int = Field(0, description="control rows copied from the previous version")
    shards: list[ShardReport] | None = Field(None, description="per shard of a sharded build (latents.shards > 1)")
