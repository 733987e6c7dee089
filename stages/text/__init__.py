"""Text stage: every distinct caption string (each variant, and the empty caption for caption dropout) encoded
once, in Zarr; with text.enabled false an artifact that records how to encode live instead."""

from __future__ import annotations

from tuneline.schemas.families import facts
from tuneline.schemas.text import PADDING, TextManifest
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.stage import StageDef, built_by
from tuneline.stages.families import resolve as models
from tuneline.stages.text.variants import TagAugment

CODE_VERSION = code_version("text")  # stages/code_versions.json


def effective_max_length(cfg) -> int:
    """Tokens every caption is padded/truncated to: text.max_length, or the family's default (its tiny flavor's
    when model.path is null)."""
    f = facts(cfg.model.family)
    return cfg.text.max_length or (f.tiny_max_length if cfg.model.path is None else 0) or f.max_length


def _config(cfg) -> dict:
    """What the cached tensors depend on. Resolved values (max_length) rather than nulls, so spelling out the
    default changes nothing; settings without effect (batch size, storage dtype with the cache off, variant
    settings with one variant) are left out so they never make text and everything downstream stale."""
    t = cfg.text
    text = {
        "enabled": t.enabled,
        "max_length": effective_max_length(cfg),
        "padding": PADDING,
        "caption_variants": t.caption_variants,
        "augment": TagAugment.from_config(t).as_dict(),
    }
    if t.enabled:
        text["dtype"] = t.dtype
    return {"text": text, "model": cfg.model.model_dump(mode="json", include={"family", "dtype"})}


def _inputs(ctx, upstream) -> dict:
    return {"text_encoders": models.identity(ctx, "text")}


STAGE = StageDef(
    name="text",
    upstream=("scan",),
    code_version=CODE_VERSION,
    manifest_cls=TextManifest,
    config=_config,
    inputs=_inputs,
    build=built_by("tuneline.stages.text.core"),
    optional_upstream=("caption",),
)
