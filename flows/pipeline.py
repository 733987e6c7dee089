"""The pipeline flow: each stage as a child flow run, in order; fresh stages are skipped inside each.

Stages run as subflows inside this flow run's process, not as deployment runs: a pipeline waiting on stage
runs that need a free worker slot would deadlock a worker started with `--limit 1` (docs/platform.md). Each stage
is still its own flow run, so a failed one shows (and is retried) on its own.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import Failed

from tuneline.flows import ops, preflight, visibility
from tuneline.flows.reporter import PrefectReporter
from tuneline.flows.stage_flows import STAGE_FLOWS, cancelled_if_stopped
from tuneline.flows.summary import timed_stage
from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common.lock import run_lease
from tuneline.stages.pipeline import stage_names


@flow(name="tuneline-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig, force: bool = False, until: str | None = None) -> dict[str, dict]:
    """scan -> (caption) -> latents -> text -> train -> validate. `force` rebuilds every stage; `until` stops after
    that stage.

    Returns per stage its path, seconds and whether it was built (for the run's summary)."""
    every = stage_names(config)
    names = every[: every.index(until) + 1] if until in every else every
    if not preflight.checked_in_this_process:  # a run from a deployment: nothing checked the paths yet
        try:
            preflight.check_paths(config)
        except preflight.Refused as err:
            return Failed(message=str(err))
    preflight.in_pipeline = True  # each stage's upstreams are built just before it
    # The run's lease on the workdir: `tuneline gc` waits for it, so nothing this run publishes or uses is collected.
    try:
        with run_lease(config.workdir_path(), timeout=config.ops.lock_timeout):
            runs = cancelled_if_stopped(
                lambda: {
                    name: timed_stage(lambda name=name: STAGE_FLOWS[name](config=config, force=force)) for name in names
                }
            )
    finally:
        preflight.in_pipeline = False
    reporter = PrefectReporter()
    reporter.table(
        "lineage",
        visibility.lineage_table(ops.lineage_rows(config)),
        "every published version: stage, version, fresh, upstream versions, created",
    )
    visibility.report_results(reporter, config, runs)
    return runs
