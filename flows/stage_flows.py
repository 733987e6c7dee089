"""One Prefect flow per stage: a failed stage is retried as its own flow run (UI or `prefect flow-run retry`)."""
from __future__ import annotations

import logging

from prefect import flow

from flows.reporter import PrefectReporter
from schemas.config import PipelineConfig
from stages.common.stage import StageContext, run_stage
from stages.pipeline import PIPELINE, stage

log = logging.getLogger("tuneline")


def run_one(name: str, config: PipelineConfig, force: bool = False) -> str:
    ctx = StageContext(config, reporter=PrefectReporter(), log=log, force=force)
    if name == "scan" and config.dataset.demo:
        from stages.scan.demo import write_demo_dataset

        write_demo_dataset(config.resolve(config.dataset.path))
    path, built = run_stage(ctx, stage(name), PIPELINE)
    log.info("%s: %s %s", name, "published" if built else "fresh, skipped:", path)
    return str(path)


@flow(name="tuneline-scan", log_prints=True)
def scan_flow(config: PipelineConfig, force: bool = False) -> str:
    """Find images and captions, read sizes, assign aspect buckets."""
    return run_one("scan", config, force)


@flow(name="tuneline-latents", log_prints=True)
def latents_flow(config: PipelineConfig, force: bool = False) -> str:
    """Cache VAE latents in Zarr (single process)."""
    return run_one("latents", config, force)


@flow(name="tuneline-text", log_prints=True)
def text_flow(config: PipelineConfig, force: bool = False) -> str:
    """Cache text embeddings (the empty caption included)."""
    return run_one("text", config, force)


@flow(name="tuneline-train", log_prints=True)
def train_flow(config: PipelineConfig, force: bool = False) -> str:
    """DDP training via torchrun, reading only the caches."""
    return run_one("train", config, force)


@flow(name="tuneline-validate", log_prints=True)
def validate_flow(config: PipelineConfig, force: bool = False) -> str:
    """Render validation images from the trained result."""
    return run_one("validate", config, force)


STAGE_FLOWS = {"scan": scan_flow, "latents": latents_flow, "text": text_flow, "train": train_flow,
               "validate": validate_flow}
