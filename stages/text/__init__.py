"""Text stage: every unique caption (and the empty caption, for caption dropout) encoded once, in Zarr."""
from __future__ import annotations

from schemas.text import TextManifest
from stages.common import models
from stages.common.stage import StageDef

CODE_VERSION = "text-1"


def _config(cfg) -> dict:
    return {"text": cfg.text.model_dump(mode="json", exclude={"batch_size"}),
            "model": cfg.model.model_dump(mode="json", include={"family", "path", "dtype"})}


def _inputs(ctx) -> dict:
    return {"text_encoders": models.identity(ctx, "text")}


def _build(ctx, work, upstream):
    from stages.text.core import build

    return build(ctx, work, upstream)


STAGE = StageDef(name="text", upstream=("scan",), code_version=CODE_VERSION, manifest_cls=TextManifest,
                 config=_config, inputs=_inputs, build=_build)
