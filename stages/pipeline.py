"""The stages in pipeline order."""
from __future__ import annotations

from stages.common.stage import StageDef
from stages.latents import STAGE as LATENTS
from stages.scan import STAGE as SCAN
from stages.text import STAGE as TEXT
from stages.train import STAGE as TRAIN
from stages.validate import STAGE as VALIDATE

PIPELINE: list[StageDef] = [SCAN, LATENTS, TEXT, TRAIN, VALIDATE]
STAGE_NAMES = [s.name for s in PIPELINE]


def stage(name: str) -> StageDef:
    for s in PIPELINE:
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}")
