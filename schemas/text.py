"""Text-embedding cache stage: config and manifest."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tuneline.schemas.base import MAX_BATCH, Manifest, Seed, Strict
from tuneline.schemas.latents import ShardReport

# The adapters pad every caption to exactly max_length tokens (stages/families/common.tokenize), so each
# field has one shape and the cache is a dense array; recorded so a different padding would change the key.
PADDING = "max_length"


class TextConfig(Strict):
    enabled: bool = Field(True, description="cache embeddings; false = encoders run live in training/validation")
    max_length: int | None = Field(None, ge=1, description="token length; null = the family's default")
    batch_size: int = Field(
        32, ge=1, le=MAX_BATCH, description="captions per encoder forward; does not change the cache"
    )
    dtype: Literal["float16", "float32"] = Field(
        "float32",
        description="stored dtype of float tensors (Zarr has no bfloat16); integer/bool tensors keep their own",
    )
    caption_variants: int = Field(
        1,
        ge=1,
        le=64,
        description="K caption variants per caption (variant 0 is the "
        "caption as written); the trainer picks one per sample. >1 needs shuffle_tags "
        "or tag_dropout",
    )
    shuffle_tags: bool = Field(
        False, description="variants shuffle the comma-separated tags (needs caption_variants > 1)"
    )
    tag_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="variants drop each tag with this probability, keeping at least one (needs caption_variants > 1)",
    )
    keep_tags: int = Field(0, ge=0, description="leading tags never shuffled or dropped (e.g. a trigger word)")
    seed: Seed = Field(0, description="seed of the variants: same seed, same variants")
    shards: int = Field(
        1,
        ge=1,
        le=1024,
        description="processes that encode at once, each its own single process "
        "owning a fixed part of the batches to encode; the cache is byte-identical to a 1-shard "
        "build, so it is not part of its version",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _no_bfloat16(cls, v: object) -> object:
        if v == "bfloat16":
            raise ValueError(
                "bfloat16 cannot be stored (Zarr has no bfloat16 dtype); use float16 (half the size) "
                "or float32 — encoders may still run in bfloat16 through model.dtype"
            )
        return v


class TensorField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shape: tuple[int, ...] = Field(description="shape of one caption's tensor")
    dtype: str


class TextManifest(Manifest):
    stage: Literal["text"] = "text"
    enabled: bool = Field(True, description="false: nothing cached; consumers encode live with these settings")
    family: str
    encoder_identity: str
    max_length: int = Field(description="tokens every caption is padded/truncated to")
    padding: str = PADDING
    variants: int = Field(1, description="variants per caption (caption_variants)")
    augment: dict = Field(
        default_factory=dict,
        description="shuffle_tags, tag_dropout, keep_tags, seed that made the variants (empty when variants is 1)",
    )
    fields: dict[str, TensorField] = Field(default_factory=dict)
    count: int = Field(0, description="distinct strings encoded = rows (the empty caption, row 0, included)")
    captions: int = Field(0, description="distinct dataset captions indexed")
    encoded: int = Field(0, description="strings run through the text encoders by this build")
    reused: int = Field(
        0,
        description="strings whose rows were copied from the previous version (same string, "
        "encoders, length, padding and stored dtype)",
    )
    store: str = "text.zarr"
    index: str = Field("captions.jsonl", description="one line per dataset caption: its variants' rows")
    strings: str = Field("strings.jsonl", description="row -> the exact string encoded")
    shards: list[ShardReport] | None = Field(None, description="per shard of a sharded build (text.shards > 1)")
