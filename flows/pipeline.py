"""The pipeline flow: each stage as a child flow run, in order; fresh stages are skipped inside each."""
from __future__ import annotations

from prefect import flow

from flows.stage_flows import STAGE_FLOWS
from schemas.config import PipelineConfig
from stages.pipeline import STAGE_NAMES


@flow(name="tuneline-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig, force: bool = False) -> dict[str, str]:
    """scan -> latents -> text -> train -> validate. `force` rebuilds every stage."""
    return {name: STAGE_FLOWS[name](config=config, force=force) for name in STAGE_NAMES}
