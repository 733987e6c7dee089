"""Validate stage: render validation prompts (and the demo's learning check) from the trained result."""

from __future__ import annotations

from tuneline.schemas.validate import ValidateManifest
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.stage import StageDef, built_by

CODE_VERSION = code_version("validate")  # stages/code_versions.json


def _config(cfg) -> dict:
    return {
        "validate": cfg.validate_.model_dump(mode="json"),
        "buckets": cfg.buckets.model_dump(mode="json", include={"resolution", "resolution_type", "alignment"}),
        "model": cfg.model.model_dump(mode="json", include={"family", "dtype", "device"}),
    }


def _inputs(ctx, upstream) -> dict:
    return {}


def _check(ctx, upstream) -> None:
    train, lat = upstream["train"], upstream["latents"]
    if train.family != ctx.cfg.model.family:
        raise ArtifactError(
            f"train {train.fingerprint} holds a {train.family} model, model.family is "
            f"{ctx.cfg.model.family}; run `tuneline stage train --force`"
        )
    if train.upstream.get("latents") != lat.fingerprint:
        raise ArtifactError(
            f"train {train.fingerprint} was trained on latents {train.upstream.get('latents')}, not "
            f"{lat.fingerprint} that the learning check would compare with; run `tuneline run`"
        )


STAGE = StageDef(
    name="validate",
    upstream=("train", "latents"),
    code_version=CODE_VERSION,
    manifest_cls=ValidateManifest,
    config=_config,
    inputs=_inputs,
    build=built_by("tuneline.stages.validate.core"),
    check=_check,
    optional_upstream=("caption",),
)
