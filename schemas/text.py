"""Text-embedding cache stage: config and manifest."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.base import Manifest, Strict


class TextConfig(Strict):
    enabled: bool = Field(True, description="cache embeddings; false = encoders run live in training/validation")
    max_length: int | None = Field(None, ge=1, description="token length; null = the family's default")
    batch_size: int = Field(32, ge=1)
    dtype: Literal["float16", "float32"] = "float32"


class TensorField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    shape: tuple[int, ...] = Field(description="shape of one caption's tensor")
    dtype: str


class TextManifest(Manifest):
    stage: Literal["text"] = "text"
    family: str
    encoder_identity: str
    max_length: int
    fields: dict[str, TensorField]
    count: int = Field(description="unique captions stored (the empty caption included)")
    store: str = "text.zarr"
    index: str = Field("captions.jsonl", description="row -> caption")
