"""Shards of a sharded latents/text build as flow runs of the `tuneline-shard` deployment on ops.shard_pool.

Each shard is its own flow run, so a pool's workers on other machines that share the workdir run them in parallel.
The stage that starts them only waits (polling the API): run it where it holds no slot of that pool (`tuneline
stage` on the machine you submit from, or the pipeline on another pool), and a pool of two one-slot workers runs
two shards at once and never deadlocks.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from tuneline.stages.common.shards import ShardJob, run_shard

POLL_S = 2.0
DEPLOYMENT = "tuneline-shard"


@flow(name=DEPLOYMENT, log_prints=True)
def shard_flow(folder: str, index: int) -> dict:
    """One shard of a sharded latents or text build; the stage starts these, with the build's shard folder."""
    return run_shard(ShardJob.load(Path(folder)), index)


def run_on_pool(job: ShardJob) -> dict[int, str]:
    """A shard runner (tuneline.stages.common.shards.RUNNER_KEY): one deployment run per shard, all at once;
    returns the shards that did not complete, with why."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    try:
        runs = {
            i: run_deployment(
                name=f"{DEPLOYMENT}/{DEPLOYMENT}",
                timeout=0,
                parameters={"folder": str(job.folder), "index": i},
                flow_run_name=f"{job.stage}-shard-{i}-of-{job.count}",
            )
            for i in range(job.count)
        }
    except ObjectNotFound:
        return {
            i: f"there is no {DEPLOYMENT} deployment: run `tuneline deploy` with this config" for i in range(job.count)
        }
    failures: dict[int, str] = {}
    with get_client(sync_client=True) as client:
        pending = dict(runs)
        while pending:
            time.sleep(POLL_S)
            for i, run in list(pending.items()):
                run = client.read_flow_run(run.id)
                if run.state is not None and run.state.is_final():
                    del pending[i]
                    if not run.state.is_completed():
                        failures[i] = (
                            f"flow run {run.name} ({run.id}) ended {run.state.name}: "
                            f"{run.state.message}; its log is in the Prefect UI"
                        )
    return failures
