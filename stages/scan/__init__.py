"""Scan stage: list a dataset folder, read image headers, caption and bucket every image.

Content-addressed: its version hashes the records it produced, so touching a file changes nothing downstream.
"""

from __future__ import annotations

from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.stage import StageDef
from tuneline.stages.scan.core import CODE_VERSION, build, content, stage_config, stage_inputs
from tuneline.stages.scan.shardscan import explain

STAGE = StageDef(
    name="scan",
    upstream=(),
    code_version=CODE_VERSION,
    manifest_cls=ScanManifest,
    config=stage_config,
    inputs=stage_inputs,
    build=build,
    content_addressed=True,
    content=content,
    explain=explain,
)

__all__ = ["STAGE"]
