"""Latents stage: VAE latent cache in Zarr, built in a single process before any training starts."""
from __future__ import annotations

from schemas.latents import LatentsManifest
from stages.common import models
from stages.common.stage import StageDef

CODE_VERSION = "latents-1"


def _config(cfg) -> dict:
    return {"latents": cfg.latents.model_dump(mode="json", exclude={"workers"}),
            "model": cfg.model.model_dump(mode="json", include={"family", "path", "dtype"})}


def _inputs(ctx) -> dict:
    return {"vae": models.identity(ctx, "vae")}


def _build(ctx, work, upstream):
    from stages.latents.core import build  # torch/diffusers load only when the stage runs

    return build(ctx, work, upstream)


STAGE = StageDef(name="latents", upstream=("scan",), code_version=CODE_VERSION, manifest_cls=LatentsManifest,
                 config=_config, inputs=_inputs, build=_build)
