"""Model selection, shared by every stage that loads weights."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Strict

FamilyName = Literal["tiny", "sd15", "sdxl", "sd3", "flux"]


class ModelConfig(Strict):
    family: FamilyName = "tiny"
    path: str | None = Field(None, description="local diffusers folder or single checkpoint file; null = the "
                             "family's built-in tiny random-init flavor")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="weights dtype for frozen parts")
    device: Literal["auto", "cpu", "cuda"] = "auto"
