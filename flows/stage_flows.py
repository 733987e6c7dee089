"""One Prefect flow per stage: a failed stage is retried as its own flow run (UI or `prefect flow-run retry`).

A retried run rebuilds only what is not fresh: upstream artifacts published before the failure are reused.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from prefect import flow
from prefect.states import Cancelled, Failed

from tuneline.flows import preflight, visibility
from tuneline.flows.limits import train_slot
from tuneline.flows.reporter import PrefectReporter
from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common.lock import store_lock
from tuneline.stages.common.stage import StageContext, StageStopped, run_stage
from tuneline.stages.pipeline import PIPELINE, stage

log = logging.getLogger("tuneline")


def refusal(name: str, config: PipelineConfig) -> str | None:
    """What `tuneline stage NAME` refuses before starting Prefect, checked again for a run started from a
    deployment (the UI, a schedule, the API), where nothing checked it first; None = go ahead."""
    if preflight.checked_in_this_process or preflight.in_pipeline:
        return None  # the CLI checked before starting this flow; within the pipeline, upstreams run first
    try:
        # Flow parameters from the UI/API went through PipelineConfig's validators, the CLI's rules included.
        preflight.check_stage(config, name)
    except preflight.Refused as err:
        return str(err)
    return None


def checked_run(name: str, config: PipelineConfig, force: bool):
    """A refused run fails with its message as the flow run's state, once (no traceback: it is no bug)."""
    refused = refusal(name, config)
    return Failed(message=refused) if refused else cancelled_if_stopped(lambda: run_one(name, config, force))


def cancelled_if_stopped(call):
    """A stage stopped on request (its checkpoint saved) ends its flow run Cancelled with the stop's message, not
    Crashed; the caller of the flow still gets the StageStopped (the CLI's exit code 3)."""
    try:
        return call()
    except StageStopped as err:
        return Cancelled(message=str(err), data=err)


def run_one(name: str, config: PipelineConfig, force: bool = False) -> str:
    # Flow parameters from the UI/API went through PipelineConfig's validators, the CLI's rules included.
    reporter = PrefectReporter()
    ctx = StageContext(config, reporter=reporter, log=log, force=force)
    if config.ops.shard_pool and name in ("latents", "text"):  # shards as flow runs on the pool's workers
        from tuneline.flows.shards import run_on_pool
        from tuneline.stages.common.shards import RUNNER_KEY

        ctx.cache[RUNNER_KEY] = run_on_pool
    lock = functools.partial(store_lock, config.workdir_path(), timeout=config.ops.lock_timeout, purpose=_purpose(name))
    whole = lock
    if name == "train" and config.train.nodes > 1:
        # Nodes sharing a workdir: a node waiting in torchrun's rendezvous must not hold the lock the other nodes
        # need to get there. The lock then guards publishing; the running training guards its own folder.
        whole, ctx.publish_lock = contextlib.nullcontext, lock
    # Slot before lock: a run waiting for a training slot must not block other stages' access to the store. A
    # multi-node training is one training and takes one slot, node 0's: with a slot per node, the other nodes on the
    # same server would wait for node 0's slot while node 0 waits for them in torchrun's rendezvous.
    takes_slot = name == "train" and config.train.node_rank == 0
    slot = train_slot(config.ops.train_concurrency) if takes_slot else contextlib.nullcontext()
    with slot, whole():
        if name == "scan" and config.dataset.demo:
            from tuneline.stages.scan.demo import write_demo_for

            write_demo_for(config)
        path, built = run_stage(ctx, stage(name), PIPELINE)
    if config.ops.remote and (path / "manifest.json").is_file():  # a non-publishing node has nothing to push
        _push(config, name, path)
    visibility.report_stage(reporter, config, name, path, built)
    return str(path)


def _purpose(name: str) -> str:
    from prefect.runtime import flow_run

    return f"stage {name}, flow run {flow_run.name or flow_run.id or '?'}"


def _push(config: PipelineConfig, name: str, path: Path) -> None:
    from tuneline.stages.common.artifacts import ArtifactStore
    from tuneline.stages.common.remote import Remote

    remote = Remote(config.ops.remote, config.ops.remote_options)
    if remote.push(ArtifactStore(config.workdir_path()), name, path.name):
        log.info("%s: pushed %s", name, remote.version_url(name, path.name))


@flow(name="tuneline-scan", log_prints=True)
def scan_flow(config: PipelineConfig, force: bool = False) -> str:
    """Find images and captions, read sizes, assign aspect buckets."""
    return checked_run("scan", config, force)


@flow(name="tuneline-caption", log_prints=True)
def caption_flow(config: PipelineConfig, force: bool = False) -> str:
    """Caption images with a local vision-language model (caption.model; single process, batched)."""
    return run_one("caption", config, force)


@flow(name="tuneline-latents", log_prints=True)
def latents_flow(config: PipelineConfig, force: bool = False) -> str:
    """Cache VAE latents in Zarr (single process)."""
    return checked_run("latents", config, force)


@flow(name="tuneline-text", log_prints=True)
def text_flow(config: PipelineConfig, force: bool = False) -> str:
    """Cache text embeddings (the empty caption included)."""
    return checked_run("text", config, force)


@flow(name="tuneline-train", log_prints=True)
def train_flow(config: PipelineConfig, force: bool = False) -> str:
    """DDP training via torchrun, reading only the caches (one global `tuneline-train` slot)."""
    return checked_run("train", config, force)


@flow(name="tuneline-validate", log_prints=True)
def validate_flow(config: PipelineConfig, force: bool = False) -> str:
    """Render validation images from the trained result."""
    return checked_run("validate", config, force)


STAGE_FLOWS = {
    "scan": scan_flow,
    "caption": caption_flow,
    "latents": latents_flow,
    "text": text_flow,
    "train": train_flow,
    "validate": validate_flow,
}
