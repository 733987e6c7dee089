"""The scan stage's core: list, probe (reusing the previous scan for unchanged files), caption, bucket."""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from tuneline.schemas.config import PipelineConfig
from tuneline.schemas.families import facts
from tuneline.schemas.scan import MEMBERS, ImageRecord, Rejected
from tuneline.schemas.sources import Source, dataset_sources
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import write_jsonl
from tuneline.stages.common.lock import active_run
from tuneline.stages.common.sizing import SizePolicy, size_policy
from tuneline.stages.common.stage import StageFailed
from tuneline.stages.scan import buckets as bk, controls, images, masks, report, samples, shardparts, shardscan, video
from tuneline.stages.scan.captions import Captions
from tuneline.stages.scan.listing import Entry, Listing, walk
from tuneline.stages.scan.probecache import load_probe_cache, save_probe_cache
from tuneline.stages.scan.records import make_record
from tuneline.stages.scan.shardfs import is_container

CODE_VERSION = code_version("scan")  # stages/code_versions.json
LISTING_KEY = "scan-listing"
# Hashing releases the GIL and header parsing is short, so a few threads keep the disk busy.
WORKERS = min(8, 2 * (os.cpu_count() or 1))
CHUNK = 64
PROGRESS_EVERY_S = 0.5


def dataset_root(cfg: PipelineConfig) -> Path:
    """The first folder (the only one without dataset.sources or train.eval.path)."""
    return dataset_sources(cfg)[0].root


def _source_cfg(cfg: PipelineConfig, src: Source):
    """The dataset settings a source's folder is walked and captioned with."""
    return cfg.dataset.model_copy(update={"caption_extension": src.caption_extension})


def alignment(cfg: PipelineConfig) -> int:
    return cfg.buckets.alignment or facts(cfg.model.family).alignment


def stage_config(cfg: PipelineConfig) -> dict:
    """What changes the records later stages consume (the path itself is an input, not config)."""
    # dataset.control is a path (an input, fingerprinted by stage_inputs), like dataset.path.
    dataset = cfg.dataset.model_dump(mode="json", exclude={"path", "demo", "sources", "control"})
    # Which folders and how each is captioned; their paths are inputs, how training uses them is train's key.
    dataset["sources"] = [{"role": s.role, "caption_extension": s.caption_extension} for s in dataset_sources(cfg)]
    # Controls read from the samples' own members (stages/scan/samples.py) shape the records: config, not input.
    for row, src in zip(dataset["sources"], dataset_sources(cfg), strict=True):
        row |= {"control": MEMBERS} if src.index in controls.by_members(cfg) else {}
    # The clip keys shape a video family's records only: an image family's scan keeps its version.
    clip_keys = set() if facts(cfg.model.family).video else {"fps", "frames", "clip"}
    buckets = cfg.buckets.model_dump(mode="json", exclude=clip_keys) | {"alignment": alignment(cfg)}
    out = {"dataset": dataset, "buckets": buckets}
    if cfg.buckets.small_bucket == "drop":  # only then does the batch decide which images are kept
        out["global_batch"] = cfg.train.global_batch()
    return out


# Within a pipeline run, the inputs its scan stage used (tuneline.stages.common.lock.active_run): the dataset's
# listing, the control folders', the masks'. The later stages of that run find the scan they started from even if a
# file (Thumbs.db) appears in one of them meanwhile; the next run decides freshness.
_pinned: dict[str, dict] = {}
CONTROLS_KEY = "scan-controls"


def _where(cfg: PipelineConfig) -> str:
    """The folders the scan reads: a config naming others in the same run is not pinned to these."""
    roots = [(s.index, str(s.root)) for s in dataset_sources(cfg)]
    ctl = sorted({str(r) for r, _ in controls.source_roots(cfg).values() if r is not None})
    return digest([roots, ctl, str(masks.mask_root(cfg))])


def stage_inputs(ctx, upstream) -> dict:
    run = active_run(ctx.workdir)
    for stale in [k for k in _pinned if k != run]:
        del _pinned[stale]
    if run is None:
        return _inputs(ctx)
    pins = _pinned.setdefault(run, {})
    where = _where(ctx.cfg)
    if where not in pins:
        pins[where] = _inputs(ctx)
    return pins[where]


def _inputs(ctx) -> dict:
    prints = []
    for src in dataset_sources(ctx.cfg):
        try:  # webdataset / parquet sources (stages/scan/shardscan.py): their shard listing
            if is_container(src):
                prints.append(shardscan.fingerprint(src))
                continue
        except StageFailed as err:
            return {"dataset": src.location, "error": str(err)}  # the scan refuses with it
        if not src.root.is_dir():
            return {"dataset": str(src.root), "missing": True}
        listing = walk(src.root, _source_cfg(ctx.cfg, src), src.field)
        # build() scans this very listing: the recorded input fingerprint then describes the files scanned,
        # and a large folder is walked once per run, not twice.
        ctx.cache[(LISTING_KEY, src.index)] = listing
        prints.append(listing.fingerprint())
    out = prints[0] if len(prints) == 1 else {"sources": prints}
    out |= {"controls": c} if (c := _controls_print(ctx)) else {}
    return out | ({"masks": m} if (m := masks.fingerprint(ctx.cfg)) else {})


def _controls_print(ctx) -> str | None:
    """The control folders' fingerprint (those walked kept for build(), as the dataset's listing is)."""
    if not controls.paired(ctx.cfg):
        return None
    try:
        found = controls.folders(ctx.cfg)
    except StageFailed as err:
        return str(err)  # the scan refuses with it; fixing the folder changes the key
    ctx.cache[CONTROLS_KEY] = found
    return controls.fingerprint(found)


def _listing(ctx, src: Source) -> Listing:
    listing = ctx.cache.pop((LISTING_KEY, src.index), None)
    return (
        listing
        if listing is not None and listing.root == src.root
        else walk(src.root, _source_cfg(ctx.cfg, src), src.field)
    )


def probe_all(ctx, entries: list[Entry], previous: dict[str, images.Probe]) -> tuple[list[images.Probe], int]:
    """A probe per image; files with the recorded size + mtime are not reopened. Returns (probes, reopened)."""
    done: dict[str, images.Probe] = {}
    todo = []
    for e in entries:
        p = previous.get(e.rel)
        if p is not None and (p.size_bytes, p.mtime_ns) == (e.size, e.mtime_ns):
            done[e.rel] = p
        else:
            todo.append(e)
    # Largest files first, in chunks small enough that every thread gets several: the last chunk left running
    # alone is then a few small files, not one thread hashing big TIFFs while the others idle.
    todo.sort(key=lambda e: -e.size)
    size = max(1, min(CHUNK, len(todo) // (WORKERS * 8)))
    chunks = [todo[i : i + size] for i in range(0, len(todo), size)]  # one future per file costs more than a probe
    read, reported = 0, time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        for n, probes in enumerate(pool.map(partial(_probe_chunk, ctx.cfg.model.family), chunks), 1):
            done.update((p.path, p) for p in probes)
            read += len(probes)
            # A Prefect progress update is an API call: a few per second, not one per chunk of a huge folder.
            if n == len(chunks) or time.monotonic() - reported >= PROGRESS_EVERY_S:
                reported = time.monotonic()
                ctx.reporter.progress(
                    "scan-progress", n / len(chunks), f"{read}/{len(todo)} new or changed images read"
                )
    return [done[e.rel] for e in entries], len(todo)


def _probe_chunk(family: str, entries: list[Entry]) -> list[images.Probe]:
    return [video.probe(e, family) for e in entries]


def policies(cfg: PipelineConfig) -> list[tuple[float | None, SizePolicy]]:
    """(resolution recorded, size policy) per buckets.resolutions entry; (None, the policy) without them."""
    base = size_policy(cfg.buckets, alignment(cfg))
    if cfg.buckets.resolutions is None:
        return [(None, base)]
    return [(r, dataclasses.replace(base, resolution=r)) for r in cfg.buckets.all_resolutions()]


def _records(ctx, src: Source, *, save: bool) -> tuple[list[ImageRecord], list[Rejected], int]:
    """One folder's records (and rejections), each named by `src.index` when the dataset has several."""
    cfg = ctx.cfg
    if is_container(src):  # webdataset / parquet (stages/scan/shardscan.py)
        got = shardscan.scan_source(ctx, src, save=save)
    else:
        samples.check(cfg, src, "folder")
        listing = _listing(ctx, src)
        probes, reopened = probe_all(ctx, listing.images, load_probe_cache(ctx, src))
        if save:
            save_probe_cache(ctx, src.root, probes)
        captions = Captions(listing, _source_cfg(cfg, src))
        got = shardscan.Members(probes, captions, listing.problems, reopened)
    records, rejected = _built(cfg, src, got)
    return records, rejected, got.reopened


def _built(cfg: PipelineConfig, src: Source, got: shardscan.Members) -> tuple[list[ImageRecord], list[Rejected]]:
    """A folder's or shards' records (with their masks) and rejections, before controls and the bucket plan."""
    records, rejected, seen = [], [*got.problems, *got.captions.problems], set()
    for resolution, policy in policies(cfg):
        # With several folders records name their folder and their resolution (docs/design.md).
        recorded = cfg.buckets.resolution if resolution is None and src.index is not None else resolution
        for probe in got.probes:
            r = make_record(probe, got.captions, policy, cfg)
            r = video.clips(r, probe, cfg) if isinstance(r, ImageRecord) else r  # a video family's clips
            if isinstance(r, list):
                for c in r:
                    if (c.ref, c.bucket_width, c.bucket_height) in seen:  # two resolutions, one bucket: once
                        continue
                    seen.add((c.ref, c.bucket_width, c.bucket_height))
                    update = {"resolution": recorded, "source": src.index, **got.fields.get(c.path, {})}
                    records.append(c.model_copy(update=update))
            elif (r.path, r.reason) not in seen:  # an unreadable file is rejected once, not per resolution
                seen.add((r.path, r.reason))
                rejected.append(r)
    if src.index is not None:  # rejections name the folder they came from
        rejected = [r.model_copy(update={"path": f"{src.index}//{r.path}"}) for r in rejected]
    records, misfits = masks.attach(records, cfg)
    records, unfit = samples.attach(records, got.parts, cfg, src)  # a webdataset sample's mask / control members
    return records, rejected + misfits + unfit


def _all_records(
    ctx, sources: list[Source], *, save: bool
) -> tuple[list[ImageRecord], list[Rejected], int, list[dict], list[str]]:
    records, rejected, reopened, rows = [], [], 0, []
    for src in sources:
        got, bad, n = _records(ctx, src, save=save)
        records += got
        rejected += bad
        reopened += n
        ctl = controls.source_roots(ctx.cfg)[src.index][0]
        rows.append({"root": src.location, "role": src.role, "images": len({r.path for r in got})})
        rows[-1] |= {"control": str(ctl)} if ctl is not None else {}
    empty = [r["root"] for r in rows if not r["images"]]
    if len(sources) > 1 and empty:
        raise StageFailed(
            f"dataset source(s) {empty} hold no usable image (see rejected.jsonl): add images, or "
            f"remove the folder from dataset.sources / train.eval.path"
        )
    records, unpaired, unmatched = controls.attach(records, ctx.cfg, ctx.cache.pop(CONTROLS_KEY, None))
    return records, rejected + unpaired, reopened, rows, unmatched


def _no_batch(root: Path, work: Path, rejected: list[Rejected], err: bk.NoBatchError) -> StageFailed:
    kinds = ", ".join(f"{k} {n}" for k, n in Counter(r.kind for r in rejected).most_common())
    examples = "; ".join(f"{r.path}: {r.reason}" for r in rejected[:3])
    return StageFailed(
        f"scan of dataset.path {root}: {err}. Rejected: {kinds or 'none'}. {examples} "
        f"(every reason: {work / 'rejected.jsonl'})"
    )


@dataclasses.dataclass
class Scanned:
    """What a scan of the current dataset publishes, computed before anything is written."""

    records: list[ImageRecord]
    rejected: list[Rejected]
    reopened: int
    sources: list[dict]
    unmatched: list[str]
    groups: list[list[str]]
    plan: dict
    rows: list
    finished: shardparts.Finished | None = None  # shard sources: images.jsonl and its digest, from kept parts

    def write(self, path: Path) -> int:
        """images.jsonl; returns the number of records."""
        return write_jsonl(path, self.records) if self.finished is None else self.finished.write(path)

    def content(self) -> str:
        return self.finished.content if self.finished else content_digest(self.records)


class NoBatch(Exception):
    def __init__(self, rejected: list[Rejected], err: bk.NoBatchError):
        super().__init__(str(err))
        self.rejected, self.err = rejected, err


def scanned(ctx, sources: list[Source], *, save: bool = True) -> Scanned:
    """Records, rejections and the bucket plan; `save` remembers the probes for the next scan."""
    cfg = ctx.cfg
    recipe = [stage_config(cfg), str(facts(cfg.model.family))]
    if fin := shardparts.finished(ctx, sources, recipe, partial(_built, cfg), save=save):
        return Scanned([], fin.rejected, fin.reopened, fin.sources, [], fin.groups, fin.plan, fin.rows, fin)
    records, rejected, reopened, source_rows, unmatched = _all_records(ctx, sources, save=save)
    groups = bk.duplicate_groups(records)
    if cfg.dataset.duplicates == "reject":
        records, dups = bk.reject_duplicates(records, groups)
        rejected += dups
    batch = cfg.train.global_batch()
    try:
        plan = bk.bucket_plan({b: len(rs) for b, rs in bk.by_bucket(records).items()}, batch, cfg.buckets.small_bucket)
    except bk.NoBatchError as err:
        raise NoBatch(sorted(rejected, key=lambda r: r.path), err) from None
    records, dropped, rows = bk.apply_plan(records, plan, batch)
    rejected = sorted(rejected + dropped, key=lambda r: r.path)
    return Scanned(records, rejected, reopened, source_rows, unmatched, groups, plan, rows)


def content_digest(records: list[ImageRecord]) -> str:
    """What later stages consume, and nothing else: records (paths relative to the root, sizes, content hashes,
    buckets, crops, captions). A moved folder, a stray non-image file or a reworded rejection leaves the version
    as it was; the republished manifest then names the new root."""
    return digest({"records": [controls.consumed(r) for r in records]})


def content(ctx) -> str | None:
    """The content digest a scan would publish now, writing nothing: files whose size and mtime the last scan
    recorded are not reopened, so a touched file costs one hash. None when the scan would fail, and before any
    scan was published (no version to reuse: a status check then reads no image and no shard)."""
    if ctx.store.latest("scan") is None:
        return None
    sources = dataset_sources(ctx.cfg)
    try:
        if any(not is_container(src) and not src.root.is_dir() for src in sources):
            return None
    except StageFailed:
        return None
    try:
        return scanned(ctx, sources, save=False).content()
    except (StageFailed, NoBatch):
        return None


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg = ctx.cfg
    sources = dataset_sources(cfg)
    root = sources[0].root
    for src in sources:
        if not is_container(src) and not src.root.is_dir():
            demo = " or set dataset.demo true" if src.field == "dataset.path" else ""
            raise StageFailed(
                f"{src.field} {src.root} is not a folder: point it at your images (relative paths "
                f"resolve against the workdir){demo}"
            )
    try:
        got = scanned(ctx, sources)
    except NoBatch as err:
        write_jsonl(work / "rejected.jsonl", err.rejected)
        raise _no_batch(root, work, err.rejected, err.err) from None
    records, rejected, unmatched, fin = got.records, got.rejected, got.unmatched, got.finished
    accepted = got.write(work / "images.jsonl")
    write_jsonl(work / "rejected.jsonl", rejected)
    report.publish(ctx, root, got.rows, got.plan, rejected, got.reopened, accepted, got.groups)
    if unmatched:
        ctx.log.warning("scan: %d control images pair with no image, e.g. %s", len(unmatched), unmatched[0])
    return {
        "alignment": alignment(cfg),
        "dataset_root": sources[0].location,
        "accepted": accepted,
        "rejected": len(rejected),
        "buckets": got.rows,
        "duplicates": got.groups,
        "rejected_by_kind": dict(sorted(Counter(r.kind for r in rejected).items())),
        "conversions": fin.conversions if fin else bk.conversions(records),
        "reopened": got.reopened,
        "sources": got.sources if sources[0].index is not None else [],
        "control_root": str(root) if (root := controls.control_root(cfg)) else None,
        "unmatched_controls": unmatched,
        "content_digest": got.content(),
        "storage_options": {s.location: s.storage_options for s in sources if s.storage_options},
        "shards_read": ctx.cache.pop(shardscan.READ_KEY, []),
        "shard_listing": ctx.cache.pop(shardscan.LISTED_KEY, {}),
    }
