"""A sharded latents build (latents.shards > 1): the blocks that need encoding split into N fixed parts, each
encoded by its own single process, then checked and completed by the stage in one pass.

The plan is a pure function of the scan's records, the block size and the previous version, so the parent and
every shard compute it alike. A nominal block is `block_rows` consecutive records of a bucket; blocks with
records to encode are dealt out so that every shard has about as much work (source and bucket pixels), and a
block with nothing to encode (linked or copied from the previous version) goes with the block before it, so an
incremental rebuild keeps every shard busy.
A shard fills its blocks with the writer a single process uses (same rows, same batches per block), so its
chunks are byte for byte a single process's. Images rejected while encoding shift the rows of later blocks:
the parent's pass (the single-process writer's resume) adopts every block that checks out at its place and
writes the rest itself, so the published cache is the 1-shard cache whatever was rejected.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tuneline.schemas.scan import ScanManifest
from tuneline.stages.common.shards import ShardJob, run_shards
from tuneline.stages.families import resolve as models
from tuneline.stages.latents import store
from tuneline.stages.latents.encode import Encoder, vae_facts_of
from tuneline.stages.latents.reuse import PreviousRows, row_identity
from tuneline.stages.latents.writer import NO_REUSE, BucketJob, BucketWriter, Reuse, Settings, fill_blocks


class LazyEncoder:
    """The VAE loaded on first use, once: a shard (or a parent) with nothing to encode never loads it."""

    def __init__(self, ctx, vae_dtype: str):
        self.ctx, self.vae_dtype = ctx, vae_dtype
        self.vae, self._encoder, self._lock = None, None, threading.Lock()

    def load(self):
        with self._lock:
            if self.vae is None:
                cfg = self.ctx.cfg
                fam, dev = models.family(cfg), models.device(cfg)
                self.vae = fam.load_vae_encoder(models.model_dir(self.ctx), models.dtype(cfg, dev), dev)
                got = str(self.vae.dtype).removeprefix("torch.")
                if got != self.vae_dtype:  # the rows' keys were computed with the dtype the VAE should run in
                    raise RuntimeError(f"the VAE loaded in {got}, the build planned {self.vae_dtype}")
                self._encoder = Encoder(self.vae, dev, cfg.latents.dtype, cfg.latents.flip)
        return self.vae

    def facts(self) -> dict | None:
        """The VAE's scaling and shift factors and per-channel statistics once loaded (the manifest records them)."""
        if self.vae is None:
            return None
        return vae_facts_of(models.family(self.ctx.cfg), self.vae)

    def submit(self, pixels, paths, expected):
        self.load()
        return self._encoder.submit(pixels, paths, expected)


# On a CPU the VAE's convolutions dominate: encoding a bucket pixel costs about as much as decoding and resizing 16
# source pixels (bench/sharded_cache.py: shards split by pixels alone finished 7 s apart, their times following their
# row counts); on a GPU the VAE is cheap beside decoding, so both weigh alike.
VAE_WEIGHT_CPU = 16


def planned_vae_dtype(cfg) -> str:
    """The dtype the VAE runs in, known without loading it."""
    return str(models.dtype(cfg, models.device(cfg))).removeprefix("torch.")


@dataclass
class Plan:
    jobs: list[BucketJob]
    settings: Settings
    reuse: Reuse
    vae_dtype: str
    vae_weight: int  # what encoding a bucket pixel costs against decoding a source pixel (see _work)


def make_plan(ctx, work: Path, scan: ScanManifest) -> Plan:
    """What the parent and every shard compute alike from the scan, the config and the previous version."""
    from tuneline.stages.latents.core import plan, scan_records

    cfg, lc = ctx.cfg, ctx.cfg.latents
    fam = models.family(cfg)
    vae_dtype = planned_vae_dtype(cfg)
    identity = row_identity(models.identity(ctx, "vae"), vae_dtype, lc.dtype, lc.flip)
    records = scan_records(models.artifact_dir(ctx, scan))
    jobs = plan(records, fam.facts.latent_channels, fam.facts.vae_factor, identity, fam.facts.temporal_factor)
    settings = Settings.of(scan, work, lc)
    previous = PreviousRows.latest(ctx, settings.names)
    weight = VAE_WEIGHT_CPU if models.device(cfg).type == "cpu" else 1
    return Plan(jobs, settings, previous if previous is not None else NO_REUSE, vae_dtype, weight)


def owners(p: Plan, count: int) -> list[list[tuple[int, int]]]:
    """Per shard, its nominal blocks as (job, block) in plan order, with about as much work each: blocks to encode
    go, costliest first, to the shard with the least work so far (ties: the block earlier in the plan, the shard
    with the lower index), so parts differ by less than one block's work; a block with nothing to encode goes with
    the block before it."""
    size = p.settings.block_rows
    blocks = [(k, b) for k, job in enumerate(p.jobs) for b in range(-(-len(job.records) // size))]
    cost = [
        _work(p.jobs[k], range(b * size, min((b + 1) * size, len(p.jobs[k].records))), p.reuse, p.vae_weight)
        for k, b in blocks
    ]
    load, owner = [0] * count, [0] * len(blocks)
    for i in sorted((i for i, c in enumerate(cost) if c), key=lambda i: (-cost[i], i)):
        owner[i] = min(range(count), key=lambda s: (load[s], s))
        load[owner[i]] += cost[i]
    out: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    for i, block in enumerate(blocks):
        if not cost[i] and i:
            owner[i] = owner[i - 1]
        out[owner[i]].append(block)
    return out


def _work(job: BucketJob, rows: range, reuse: Reuse, vae_weight: int) -> int:
    """What encoding these rows costs: each row to encode decodes its source image (a 3000² photo costs more than a
    600² one in the same bucket) and encodes its bucket, a bucket pixel weighing `vae_weight` source pixels; reused
    rows cost nothing."""
    bucket = job.width * job.height * vae_weight
    return sum(job.records[i].width * job.records[i].height + bucket for i in rows if job.row_keys[i] not in reuse)


def runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Consecutive blocks of one bucket as (job, first block, end block)."""
    out: list[tuple[int, int, int]] = []
    for k, b in blocks:
        if out and out[-1][0] == k and out[-1][2] == b:
            out[-1] = (k, out[-1][1], b + 1)
        else:
            out.append((k, b, b + 1))
    return out


def run_shard(ctx, job: ShardJob, index: int) -> dict:
    """A shard's body: resume its finished blocks, fill the rest of its runs; never touches another's blocks."""
    from tuneline.stages.latents.core import single_process

    single_process()
    scan = ctx.store.read(ctx.store.version_dir("scan", job.upstream["scan"]), ScanManifest)
    p = make_plan(ctx, Path(job.work), scan)
    mine = owners(p, job.count)[index]
    encoder = LazyEncoder(ctx, p.vae_dtype)
    counts = {"encoded": 0, "reused": 0, "resumed": 0}
    with ThreadPoolExecutor(ctx.cfg.latents.workers, thread_name_prefix="latents-decode") as pool:
        for k, first, end in runs(mine):
            w = BucketWriter(p.settings, p.jobs[k])
            w.at(first)
            consumed = first * p.settings.block_rows
            while w.blocks < end and (n := w.adopt(consumed)):  # blocks a killed run of this shard finished
                consumed += n
            if w.blocks < end and consumed < len(p.jobs[k].records):
                fill_blocks(w, consumed, encoder, p.reuse, pool, lambda n: None, stop=end)
            for key in counts:
                counts[key] += getattr(w.out, key)
    ctx.log.info("latents shard %d: %d blocks, %s", index, len(mine), counts)
    return {"blocks": len(mine), **counts, "vae": encoder.facts()}


def build_sharded(ctx, work: Path, scan: ScanManifest, upstream_versions: dict) -> tuple[Plan, LazyEncoder, list]:
    """Start the shards on a plan whose arrays exist, wait for all; returns what the parent's pass needs."""
    lc = ctx.cfg.latents
    if ctx.force:  # --force: resume nothing either
        for done in (store.BLOCKS, store.STORE):
            shutil.rmtree(work / done, ignore_errors=True)
    p = make_plan(ctx, work, scan)
    s = p.settings
    for job in p.jobs:  # made here, once: shards only write chunk files and block records
        store.create_arrays(work, job.key, job.shape, len(job.records), s.dtype, s.block_rows, s.names)
    job = ShardJob(
        stage="latents",
        work=str(work.resolve()),
        count=lc.shards,
        force=ctx.force,
        upstream=upstream_versions,
        config=ctx.cfg.dump(),
    )
    reports = run_shards(ctx, job)
    encoder = LazyEncoder(ctx, p.vae_dtype)
    return p, encoder, reports


def shard_entries(reports: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("index", "blocks", "encoded", "seconds", "peak_rss")} for r in reports]


def vae_facts(reports: list[dict], encoder: LazyEncoder) -> dict:
    """Scaling and shift factors from a shard that loaded the VAE, else from loading it here."""
    for r in reports:
        if r.get("vae"):
            return r["vae"]
    encoder.load()
    return encoder.facts()
