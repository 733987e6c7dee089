"""The stages in pipeline order."""

from __future__ import annotations

from tuneline.stages.caption import STAGE as CAPTION
from tuneline.stages.common.stage import StageDef
from tuneline.stages.latents import STAGE as LATENTS
from tuneline.stages.scan import STAGE as SCAN
from tuneline.stages.text import STAGE as TEXT
from tuneline.stages.train import STAGE as TRAIN
from tuneline.stages.validate import STAGE as VALIDATE

# caption runs only when caption.model is set (StageDef.enabled); text, train and validate then read its captions.
PIPELINE: list[StageDef] = [SCAN, CAPTION, LATENTS, TEXT, TRAIN, VALIDATE]
STAGE_NAMES = [s.name for s in PIPELINE]


def stages_for(cfg) -> list[StageDef]:
    """The stages this config runs, in order (caption only with caption.model set)."""
    return [s for s in PIPELINE if s.enabled is None or s.enabled(cfg)]


def stage_names(cfg) -> list[str]:
    return [s.name for s in stages_for(cfg)]


def stage(name: str) -> StageDef:
    for s in PIPELINE:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}")
