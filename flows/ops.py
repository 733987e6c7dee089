"""Operations over a workdir that need the pipeline's stage list: lineage, gc, remote push/pull."""

from __future__ import annotations

import contextlib

from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.gc import GcPlan, collect, plan
from tuneline.stages.common.lineage import Version, lineage
from tuneline.stages.common.lock import exclusive_runs, store_lock
from tuneline.stages.common.remote import Remote
from tuneline.stages.common.stage import StageContext, status
from tuneline.stages.pipeline import PIPELINE, STAGE_NAMES


def fresh_versions(cfg: PipelineConfig) -> dict[str, str | None]:
    """Per stage, the published version the next run of the current config reuses (None if not fresh)."""
    rows = status(StageContext(cfg), PIPELINE, reuse=True)
    return {r.stage: r.version if r.state == "fresh" else None for r in rows}


def lineage_rows(cfg: PipelineConfig) -> list[Version]:
    return lineage(ArtifactStore(cfg.workdir_path()), STAGE_NAMES, fresh_versions(cfg))


def gc(cfg: PipelineConfig, keep: int, *, dry_run: bool = False, partial: bool = False) -> tuple[GcPlan, int]:
    """Plan (and unless dry_run, apply) housekeeping under the store lock: no stage writes meanwhile; and, unless
    dry_run, with no pipeline run in progress (its lease), since a run between two stages holds no store lock."""
    wd, timeout = cfg.workdir_path(), cfg.ops.lock_timeout
    runs = contextlib.nullcontext() if dry_run else exclusive_runs(wd, timeout=timeout)
    with runs, store_lock(wd, timeout=timeout, purpose="tuneline gc"):
        p = plan(ArtifactStore(cfg.workdir_path()), STAGE_NAMES, fresh_versions(cfg), keep)
        if cfg.dataset.demo:  # build folders of killed demo generations
            from tuneline.stages.scan.demo import leftovers

            p.partial += leftovers(cfg.resolve(cfg.dataset.path))
        return p, 0 if dry_run else collect(p, partial=partial)


def remote(cfg: PipelineConfig) -> Remote:
    if not cfg.ops.remote:
        raise ValueError("ops.remote is not set: put the object-storage URL (e.g. s3://bucket/prefix) in the config")
    return Remote(cfg.ops.remote, cfg.ops.remote_options)


def push(cfg: PipelineConfig, stages: list[str] | None = None) -> list[str]:
    """Push the fresh version of each stage (all stages by default); returns the remote URLs pushed now."""
    r, store, fresh = remote(cfg), ArtifactStore(cfg.workdir_path()), fresh_versions(cfg)
    out = []
    for stage in stages or STAGE_NAMES:
        version = fresh.get(stage)
        if version is None:
            raise ValueError(f"stage {stage} has no fresh version to push; run `tuneline stage {stage}` first")
        if r.push(store, stage, version):
            out.append(r.version_url(stage, version))
    return out


def pull(cfg: PipelineConfig, stage: str, version: str) -> str:
    with store_lock(cfg.workdir_path(), timeout=cfg.ops.lock_timeout, purpose=f"tuneline remote pull {stage}"):
        return str(remote(cfg).pull(ArtifactStore(cfg.workdir_path()), stage, version))
