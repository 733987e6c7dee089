"""Resolve the configured model once per run: family adapter, model folder, device, dtype."""
from __future__ import annotations

from pathlib import Path

import torch

from schemas.config import PipelineConfig
from stages.families.base import Family
from stages.families.registry import get_family

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def family(cfg: PipelineConfig) -> Family:
    return get_family(cfg.model.family)


def model_dir(ctx) -> Path:
    """The diffusers folder of the configured model (the tiny flavor is built once under the workdir)."""
    cfg = ctx.cfg
    return ctx.memo("model_dir", lambda: family(cfg).ensure_model(cfg.model.path, ctx.workdir / "models"))


def identity(ctx, component: str) -> str:
    return ctx.memo(f"identity:{component}", lambda: family(ctx.cfg).identity(model_dir(ctx), component))


def device(cfg: PipelineConfig) -> torch.device:
    if cfg.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is cuda but no CUDA device is visible: set model.device to auto or cpu")
    return torch.device(cfg.model.device)


def dtype(cfg: PipelineConfig, dev: torch.device) -> torch.dtype:
    """Frozen-weights dtype; half precision on CPU is slow or unsupported for conv ops, so CPU keeps float32."""
    dt = DTYPES[cfg.model.dtype]
    return torch.float32 if dev.type == "cpu" and dt == torch.float16 else dt


def artifact_dir(ctx, manifest) -> Path:
    return ctx.store.version_dir(manifest.stage, manifest.fingerprint)
