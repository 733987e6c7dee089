"""Resolve the configured model once per run: family adapter, model folder, device, dtype.

Folder checks and identities are file work (tuneline.stages.families.folders): planning and `tuneline status` never
import torch or diffusers unless a model must be built or converted first."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.families import facts
from tuneline.stages.families import folders

if TYPE_CHECKING:
    import torch

    from tuneline.stages.families.base import Family


def dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def family(cfg: PipelineConfig) -> Family:
    from tuneline.stages.families.registry import get_family

    return get_family(cfg.model.family)


def input_area(cfg: PipelineConfig) -> int | None:
    """Pixels an edit family's pipeline scales its input images to in this run: the tiny flavor's
    (FamilyFacts.tiny_input_area) when model.path is null, else None: the pipeline's own."""
    return (facts(cfg.model.family).tiny_input_area if cfg.model.path is None else 0) or None


def model_dir(ctx) -> Path:
    """The diffusers folder of the configured model (the tiny flavor is built once under the workdir)."""
    return ctx.memo("model_dir", lambda: _model_dir(ctx.cfg, ctx.workdir / "models"))


def _model_dir(cfg: PipelineConfig, cache_dir: Path) -> Path:
    f = facts(cfg.model.family)
    ready = folders.tiny_dir(f, cache_dir) if cfg.model.path is None else Path(cfg.model.path).expanduser()
    if ready.is_dir():  # an existing folder needs no model code, only a check of its files
        folders.check_folder(f, ready)
        return ready.resolve()
    # Builds the tiny flavor, or converts a single file (configs from model.config when set).
    m = cfg.model
    return family(cfg).ensure_model(m.path, cache_dir, m.config, m.text_encoder_path, m.vae_path, expert=m.expert)


def identity(ctx, component: str) -> str:
    return ctx.memo(
        f"identity:{component}", lambda: folders.identity(facts(ctx.cfg.model.family), model_dir(ctx), component)
    )


def device(cfg: PipelineConfig) -> torch.device:
    import torch

    if cfg.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.model.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is cuda but no CUDA device is visible: set model.device to auto or cpu")
    return torch.device(cfg.model.device)


def dtype(cfg: PipelineConfig, dev: torch.device) -> torch.dtype:
    """Frozen-weights dtype; half precision on CPU is slow or unsupported for conv ops, so CPU keeps float32."""
    import torch

    dt = dtypes()[cfg.model.dtype]
    return torch.float32 if dev.type == "cpu" and dt == torch.float16 else dt


def artifact_dir(ctx, manifest) -> Path:
    return ctx.store.version_dir(manifest.stage, manifest.fingerprint)
