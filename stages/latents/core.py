"""Latent caching: one process, the family's VAE, whole blocks per bucket, resumable and incremental.

Spine: read the scan's records -> plan rows per bucket -> per bucket: resume finished blocks, then copy rows
the previous version already holds and encode the rest (decoding overlaps the VAE) -> index + manifest facts.
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from tuneline.schemas.scan import ImageRecord, ScanManifest
from tuneline.stages.common.artifacts import ArtifactError
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl
from tuneline.stages.common.sizing import latent_frames, latent_shape
from tuneline.stages.families import resolve as models
from tuneline.stages.latents import controls, masks, size_policy, store
from tuneline.stages.latents.encode import Encoder, vae_facts_of
from tuneline.stages.latents.reuse import PreviousRows, row_identity, row_key
from tuneline.stages.latents.writer import NO_REUSE, BucketJob, BucketResult, BucketWriter, Settings, fill_blocks
from tuneline.stages.scan.masks import mask_root

PROGRESS_KEY = "latents-progress"
PROGRESS_EVERY_S = 1.0  # Prefect progress artifacts are API calls: update at most this often


class Progress:
    """A terminal progress bar (when stderr is a terminal) and the reporter's progress artifact."""

    def __init__(self, reporter, total: int):
        self.reporter, self.total, self.done, self.last = reporter, max(1, total), 0, 0.0
        self.bar = tqdm(total=total, desc="latents", unit="img", disable=None)

    def advance(self, n: int) -> None:
        self.done += n
        self.bar.update(n)
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S or self.done >= self.total:
            self.last = now
            self.reporter.progress(PROGRESS_KEY, self.done / self.total, f"{self.done}/{self.total} images cached")

    def close(self) -> None:
        self.bar.close()


def scan_records(scan_dir: Path) -> list[ImageRecord]:
    return [ImageRecord.model_validate(r) for r in read_jsonl(scan_dir / "images.jsonl")]


def plan(
    records: list[ImageRecord], channels: int, vae_factor: int, identity: dict, temporal: int = 0
) -> list[BucketJob]:
    """One job per bucket, rows sorted by path: the layout depends on the records alone. A video family's clips
    (`temporal`: its VAE's frames per latent frame) are bucketed by frame count too."""
    by_bucket: dict[tuple[int, int, int], list[ImageRecord]] = defaultdict(list)
    for r in records:
        by_bucket[(r.bucket_width, r.bucket_height, r.frames or 1)].append(r)
    jobs = []
    for (w, h, frames), recs in sorted(by_bucket.items()):
        recs.sort(key=lambda r: r.ref)
        jobs.append(
            BucketJob(
                key=store.bucket_key(w, h, frames),
                width=w,
                height=h,
                shape=latent_shape(w, h, channels, vae_factor, latent_frames(frames, temporal)),
                frames=frames if temporal else None,
                records=recs,
                row_keys=[row_key(r, identity) for r in recs],
            )
        )
    return jobs


def single_process() -> None:
    """Caching inside a multi-process launch caches nothing useful (docs/design.md): refuse it."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "the latents stage runs in one process, before training: run `tuneline stage latents` "
            "(or `tuneline run`), not under torchrun / a distributed launcher"
        )


def build(ctx, work: Path, upstream: dict) -> dict:
    single_process()
    if ctx.cfg.latents.shards > 1:
        return build_sharded(ctx, work, upstream)
    cfg, lc = ctx.cfg, ctx.cfg.latents
    scan: ScanManifest = upstream["scan"]
    records = scan_records(models.artifact_dir(ctx, scan))
    fam, dev = models.family(cfg), models.device(cfg)
    vae = fam.load_vae_encoder(models.model_dir(ctx), models.dtype(cfg, dev), dev)
    vae_dtype = str(vae.dtype).removeprefix("torch.")
    identity = row_identity(models.identity(ctx, "vae"), vae_dtype, lc.dtype, lc.flip)
    jobs = plan(records, fam.facts.latent_channels, fam.facts.vae_factor, identity, fam.facts.temporal_factor)
    if ctx.force:  # --force: resume nothing either
        for done in (store.BLOCKS, store.STORE):
            shutil.rmtree(work / done, ignore_errors=True)
    settings = Settings.of(scan, work, lc)
    encoder = Encoder(vae, dev, lc.dtype, lc.flip)
    results = write_buckets(ctx, settings, jobs, encoder, len(records))
    facts = manifest_facts(ctx, work, scan, results, jobs, fam, vae_facts_of(fam, vae), vae_dtype)
    log_rows(ctx, facts)
    paired = write_controls(ctx, work, results, jobs, records, encoder, identity, scan)
    return facts | {"masked": write_masks(ctx, work, results, records, scan)} | paired


def write_controls(
    ctx, work: Path, results, jobs: list[BucketJob], records, encoder: Encoder, identity: dict, scan: ScanManifest
) -> dict:
    """Control latents of a paired dataset beside the targets (stages/latents/controls.py)."""
    index = [row for r in results for row in r.index]
    shapes = {j.key: j.shape for j in jobs}
    return controls.write_controls(ctx, work, index, records, scan.control_sources(), encoder, shapes, identity)


def write_masks(ctx, work: Path, results: list[BucketResult], records: list[ImageRecord], scan: ScanManifest) -> int:
    index = [row for r in results for row in r.index]
    return masks.write_masks(
        work, index, records, scan.roots(), mask_root(ctx.cfg), models.family(ctx.cfg).facts.vae_factor
    )


def build_sharded(ctx, work: Path, upstream: dict) -> dict:
    """latents.shards processes encode their parts (stages/latents/shard.py); this one then adopts every block that
    checks out, writes what rejected images moved, and publishes one version."""
    from tuneline.stages.latents import shard

    scan: ScanManifest = upstream["scan"]
    p, encoder, reports = shard.build_sharded(ctx, work, scan, {"scan": scan.fingerprint})
    records = [r for job in p.jobs for r in job.records]
    results = write_buckets(ctx, p.settings, p.jobs, encoder, len(records))
    fam = models.family(ctx.cfg)
    facts = manifest_facts(ctx, work, scan, results, p.jobs, fam, shard.vae_facts(reports, encoder), p.vae_dtype)
    # The parent adopted the shards' rows as resumed; count them as the shards made them.
    for key in ("encoded", "reused"):
        facts[key] += sum(r[key] for r in reports)
    facts["resumed"] = max(0, facts["count"] - facts["encoded"] - facts["reused"])
    log_rows(ctx, facts, f" by {len(reports)} shards")
    lc = ctx.cfg.latents
    identity = row_identity(models.identity(ctx, "vae"), p.vae_dtype, lc.dtype, lc.flip)
    all_records = scan_records(models.artifact_dir(ctx, scan))
    return (
        facts
        | write_controls(ctx, work, results, p.jobs, all_records, encoder, identity, scan)
        | {
            "masked": write_masks(ctx, work, results, all_records, scan),
            "shards": shard.shard_entries(reports),
        }
    )


def write_buckets(ctx, s: Settings, jobs: list[BucketJob], encoder: Encoder, total: int) -> list[BucketResult]:
    previous = PreviousRows.latest(ctx, s.names)
    reuse = previous if previous is not None else NO_REUSE
    progress = Progress(ctx.reporter, total)
    results = []
    try:
        with ThreadPoolExecutor(ctx.cfg.latents.workers, thread_name_prefix="latents-decode") as pool:
            for job in jobs:
                writer = BucketWriter(s, job)
                start = writer.resume()
                progress.advance(start)
                results.append(fill_blocks(writer, start, encoder, reuse, pool, progress.advance).finish())
    finally:
        progress.close()
    return results


def log_rows(ctx, facts: dict, by: str = "") -> None:
    """The build's row counts, once: a sharded build counts its rows as the shards made them (the parent adopts
    them as resumed), so it logs after correcting them."""
    ctx.log.info(
        "latents: %d rows%s (%d encoded, %d copied from the previous version, %d resumed), %d rejected",
        facts["count"],
        by,
        facts["encoded"],
        facts["reused"],
        facts["resumed"],
        facts["rejected"],
    )


def manifest_facts(
    ctx,
    work: Path,
    scan: ScanManifest,
    results: list[BucketResult],
    jobs: list[BucketJob],
    fam,
    vae_facts: dict,
    vae_dtype: str,
) -> dict:
    """Write the index and rejections; the manifest facts a consumer checks before reading."""
    cfg = ctx.cfg
    index = [row for r in results for row in r.index]
    rejected = sorted((x for r in results for x in r.rejected), key=lambda x: x.path)
    write_jsonl(work / store.INDEX, index)
    write_jsonl(work / "rejected.jsonl", rejected)
    for x in rejected[:20]:
        ctx.log.warning("latents: rejected %s: %s", x.path, x.reason)
    if not index:
        raise ArtifactError(
            f"no image of scan version {scan.fingerprint} could be encoded; see the reasons in "
            f"{work / 'rejected.jsonl'} and fix the dataset"
        )
    buckets = [
        {"width": j.width, "height": j.height, "shape": j.shape, "count": len(r.index), "array": j.key}
        | ({"frames": j.frames} if j.frames else {})
        for j, r in zip(jobs, results)
        if r.index
    ]
    counts = {k: sum(getattr(r, k) for r in results) for k in ("encoded", "reused", "resumed")}
    return {
        "family": fam.facts.name,
        "vae_identity": models.identity(ctx, "vae"),
        "vae_dtype": vae_dtype,
        "vae_factor": fam.facts.vae_factor,
        "latent_channels": fam.facts.latent_channels,
        **vae_facts,
        "dtype": cfg.latents.dtype,
        "flip": cfg.latents.flip,
        "block_rows": cfg.latents.block_rows,
        "size_policy": size_policy(cfg),
        "buckets": buckets,
        "count": len(index),
        "rejected": len(rejected),
        **counts,
    }
