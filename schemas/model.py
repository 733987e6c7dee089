"""Model selection, shared by every stage that loads weights."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from tuneline.schemas.base import ConfigPath, Strict
from tuneline.schemas.families import DEFAULT_FAMILY, SHIPPED_CONFIGS, SHIPPED_TITLES, FamilyName, variant_family

# Users of other trainers ask for fp8 weights; torch implements matmul for float8 but not conv2d, layer/group
# norm or softmax (tests/unit/test_config_checks.py asserts this), and every family's VAE, text encoders and
# denoiser use them. No stage keeps weights in fp8 while computing in bf16, so fp8 is refused up front.
# Weightless pipeline folders shipped in stages/families/configs/ (SHIPPED_CONFIGS, name -> family): model.config
# may name one.
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "fp8")


class ModelConfig(Strict):
    family: FamilyName = DEFAULT_FAMILY
    path: Annotated[str | None, ConfigPath()] = Field(
        None,
        description="local diffusers folder or single checkpoint file (relative: against the workdir); null = "
        "the family's built-in tiny random-init flavor",
    )
    config: Annotated[str | None, ConfigPath(keywords=tuple(SHIPPED_CONFIGS))] = Field(
        None,
        description="with model.path a single checkpoint file: a shipped config ("
        + ", ".join(f"{n} = {t}" for n, t in SHIPPED_TITLES.items())
        + ": configs and tokenizers, no weights) or a local diffusers folder of the same model "
        "(./name for a folder so named) whose configs and tokenizers describe the file's model, "
        "so the file loads offline; components the file lacks (the VAE and text encoders of a "
        "transformer-only file) are loaded from that folder's weights; null = the family's "
        "shipped config when the file's shapes fit it. A shipped config of another layout of model.family (Wan "
        "2.2's TI2V 5B) also picks that layout; with model.path null, its tiny flavor",
    )
    text_encoder_path: Annotated[str | None, ConfigPath()] = Field(
        None,
        description="with model.path a transformer-only .safetensors file (as ComfyUI distributes them): the "
        "text encoder's file (transformers layout; fp8 or scaled fp8 is dequantized at load); null = model.config's",
    )
    vae_path: Annotated[str | None, ConfigPath()] = Field(
        None,
        description="with model.path a transformer-only .safetensors file: the VAE's file (diffusers or original "
        "layout; fp8 or scaled fp8 is dequantized at load); null = model.config's",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="weights dtype for frozen parts (fp8 is not supported: see FP8_DTYPES)"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto",
        description="what an epsilon/v family's denoiser predicts; auto = the model's scheduler config "
        "(set v_prediction for a v-prediction checkpoint whose config says otherwise)",
    )
    quantize: Literal["int8", "fp8"] | None = Field(
        None,
        description="quantize the frozen denoiser's linear "
        "layers (torchao) under a LoRA; only with train.mode lora; "
        "fp8 needs a CUDA GPU with float8 support",
    )

    expert: Literal["high", "low", "both"] | None = Field(
        None,
        description="a family with timestep experts (Wan 2.2 A14B): train the high-noise expert, the low-noise one, "
        "or both as one run (each sample's timestep picks its expert), one LoRA per expert; null = both. "
        "Refused for families with one denoiser",
    )

    @model_validator(mode="before")
    @classmethod
    def _variant(cls, data: object) -> object:
        """A family's other layout (FamilyFacts.variant_of: Wan 2.2's TI2V 5B) is trained as its own row: picked by
        model.config naming it (with model.path null: its tiny flavor) or by the model folder's model_index.json."""
        if not isinstance(data, dict):
            return data
        variant = variant_family(data.get("family", DEFAULT_FAMILY), data.get("config"), data.get("path"))
        if variant is None:
            return data
        tiny = data.get("path") is None and data.get("config") == variant
        return {**data, "family": variant} | ({"config": None} if tiny else {})

    @field_validator("dtype", mode="before")
    @classmethod
    def _no_fp8(cls, v: object) -> object:
        if isinstance(v, str) and v.lower() in FP8_DTYPES:
            raise ValueError(
                f"{v} weights cannot be used: torch has no float8 kernels for conv2d, layer/group "
                f"norm and softmax, which the VAE, text encoders and denoiser of every family need "
                f"(training and encoding would stop with 'not implemented for Float8'); use "
                f"bfloat16 on a GPU (half the memory of float32) or float32; to keep a LoRA's frozen base in 8 bits "
                f"use model.quantize (int8, or fp8 on a float8 GPU)"
            )
        return v

    @model_validator(mode="after")
    def _config_needs_a_file(self) -> ModelConfig:
        if self.config is not None and self.path is None:
            raise ValueError(
                "model.config describes a single checkpoint file given as model.path; with model.path "
                "null (the tiny flavor) set model.config null"
            )
        for name in ("text_encoder_path", "vae_path"):
            if getattr(self, name) is not None and self.path is None:
                raise ValueError(
                    f"model.{name} goes beside a transformer file given as model.path; with model.path null "
                    f"(the tiny flavor) set model.{name} null"
                )
        shipped_family = SHIPPED_CONFIGS.get(self.config or "")
        if shipped_family is not None and shipped_family != self.family:
            raise ValueError(
                f"model.config: {self.config} is the shipped {shipped_family} config but model.family is "
                f"{self.family}; set model.family {shipped_family}, or set model.config to a "
                f"{self.family} config"
            )
        return self
