"""The scan stage's core: list, probe (reusing the previous scan for unchanged files), caption, bucket."""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from schemas.config import PipelineConfig
from schemas.families import facts
from schemas.scan import ImageRecord, Rejected, ScanManifest
from stages.common.artifacts import ArtifactError
from stages.common.hashing import digest
from stages.common.jsonl import read_jsonl, write_jsonl
from stages.common.sizing import SizePolicy, bucket_size, crop_box, size_policy, size_problem
from stages.scan import buckets as bk
from stages.scan import images
from stages.scan.captions import CaptionError, Captions
from stages.scan.listing import Entry, walk

CODE_VERSION = "2"
PROBES = "probes.jsonl"  # header facts per file, so the next scan reopens only what changed
# Hashing releases the GIL and header parsing is short, so a few threads keep the disk busy.
WORKERS = min(8, 2 * (os.cpu_count() or 1))


def dataset_root(cfg: PipelineConfig) -> Path:
    return cfg.resolve(cfg.dataset.path)


def alignment(cfg: PipelineConfig) -> int:
    return cfg.buckets.alignment or facts(cfg.model.family).alignment


def stage_config(cfg: PipelineConfig) -> dict:
    """What changes the records later stages consume (the path itself is an input, not config)."""
    out = {"dataset": cfg.dataset.model_dump(mode="json", exclude={"path", "demo"}),
           "buckets": cfg.buckets.model_dump(mode="json") | {"alignment": alignment(cfg)}}
    if cfg.buckets.small_bucket == "drop":  # only then does the batch decide which images are kept
        out["global_batch"] = bk.global_batch(cfg)
    return out


def stage_inputs(ctx) -> dict:
    root = dataset_root(ctx.cfg)
    if not root.is_dir():
        return {"dataset": str(root), "missing": True}
    return walk(root, ctx.cfg.dataset).fingerprint()


def previous_probes(ctx, root: Path) -> dict[str, images.Probe]:
    """Probes of the latest published scan of this same folder and code (anything else: scan cold)."""
    latest = ctx.store.latest("scan")
    if latest is None or not (latest / PROBES).is_file():
        return {}
    try:
        m = ctx.store.read(latest, ScanManifest)
        if m.dataset_root != str(root) or m.code_version != CODE_VERSION:
            return {}
        return {row["path"]: images.Probe(**row) for row in read_jsonl(latest / PROBES)}
    except (ArtifactError, ValueError, TypeError, KeyError) as err:
        ctx.log.warning("scan: not reusing %s (%s); every file is read", latest, err)
        return {}


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
    every = max(1, len(todo) // 20)
    with ThreadPoolExecutor(WORKERS) as pool:
        results = pool.map(lambda e: images.probe_file(e.path, e.rel, e.size, e.mtime_ns), todo)
        for i, probe in enumerate(results, 1):
            done[probe.path] = probe
            if i % every == 0 or i == len(todo):
                ctx.reporter.progress("scan-progress", i / len(todo), f"{i}/{len(todo)} changed images read")
    return [done[e.rel] for e in entries], len(todo)


def make_record(probe: images.Probe, captions: Captions, policy: SizePolicy, cfg: PipelineConfig
                ) -> ImageRecord | Rejected:
    def reject(kind: str, reason: str) -> Rejected:
        return Rejected(path=probe.path, kind=kind, reason=reason)

    if probe.error:
        return reject(probe.kind, probe.error)
    w, h, limit = probe.width, probe.height, cfg.dataset.max_image_pixels
    if w * h > limit:
        return reject("bomb", f"decompression-bomb guard: {w}x{h} = {w * h} pixels exceeds "
                              f"dataset.max_image_pixels ({limit}); raise the limit if the image is genuine")
    problem = size_problem(w, h, policy)
    if problem:
        return reject("too-small", problem)
    try:
        caption, source = captions.caption_for(probe.path)
    except CaptionError as err:
        return reject("caption", str(err))
    bw, bh = bucket_size(w, h, policy)
    return ImageRecord(path=probe.path, width=w, height=h, bucket_width=bw, bucket_height=bh,
                       crop=crop_box(w, h, bw, bh, cfg.buckets.crop, cfg.buckets.seed, key=probe.path),
                       caption=caption, caption_source=source, sha256=probe.sha256, size_bytes=probe.size_bytes,
                       mtime_ns=probe.mtime_ns, format=probe.format, mode=probe.mode, orientation=probe.orientation,
                       conversion=probe.conversion,
                       background=cfg.dataset.background if probe.transparent else None)


def _records(ctx, root: Path, work: Path) -> tuple[list[ImageRecord], list[Rejected], int]:
    cfg = ctx.cfg
    listing = walk(root, cfg.dataset)
    probes, reopened = probe_all(ctx, listing.images, previous_probes(ctx, root))
    write_jsonl(work / PROBES, [p.as_json() for p in probes])
    captions = Captions(listing, cfg.dataset)
    policy = size_policy(cfg.buckets, alignment(cfg))
    records, rejected = [], [*listing.problems, *captions.problems]
    for probe in probes:
        r = make_record(probe, captions, policy, cfg)
        (records if isinstance(r, ImageRecord) else rejected).append(r)
    return records, rejected, reopened


def _no_batch(root: Path, work: Path, rejected: list[Rejected], err: bk.NoBatchError) -> ArtifactError:
    kinds = ", ".join(f"{k} {n}" for k, n in Counter(r.kind for r in rejected).most_common())
    examples = "; ".join(f"{r.path}: {r.reason}" for r in rejected[:3])
    return ArtifactError(f"scan of dataset.path {root}: {err}. Rejected: {kinds or 'none'}. {examples} "
                         f"(every reason: {work / 'rejected.jsonl'})")


def build(ctx, work: Path, upstream: dict) -> dict:
    cfg = ctx.cfg
    root = dataset_root(cfg)
    if not root.is_dir():
        raise ArtifactError(f"dataset.path {root} is not a folder: point dataset.path at your images "
                            f"(relative paths resolve against the workdir) or set dataset.demo true")
    records, rejected, reopened = _records(ctx, root, work)
    groups = bk.duplicate_groups(records)
    if cfg.dataset.duplicates == "reject":
        records, dups = bk.reject_duplicates(records, groups)
        rejected += dups
    batch = bk.global_batch(cfg)
    write_jsonl(work / "rejected.jsonl", sorted(rejected, key=lambda r: r.path))
    try:
        plan = bk.bucket_plan({b: len(rs) for b, rs in bk.by_bucket(records).items()}, batch,
                              cfg.buckets.small_bucket)
    except bk.NoBatchError as err:
        raise _no_batch(root, work, rejected, err) from None
    records, dropped, rows = bk.apply_plan(records, plan, batch)
    rejected = sorted(rejected + dropped, key=lambda r: r.path)
    write_jsonl(work / "images.jsonl", records)
    write_jsonl(work / "rejected.jsonl", rejected)
    _report(ctx, root, rows, plan, rejected, reopened, len(records))
    consumed = [r.model_dump(mode="json", exclude={"mtime_ns"}) for r in records]
    return {"alignment": alignment(cfg), "dataset_root": str(root), "accepted": len(records),
            "rejected": len(rejected), "buckets": rows, "duplicates": groups,
            "rejected_by_kind": dict(sorted(Counter(r.kind for r in rejected).items())),
            "conversions": bk.conversions(records), "reopened": reopened,
            "content_digest": digest({"records": consumed, "rejected": [r.model_dump() for r in rejected]})}


def _report(ctx, root: Path, rows, plan, rejected: list[Rejected], reopened: int, accepted: int) -> None:
    ctx.reporter.table("scan-buckets", bk.table(rows, plan),
                       f"{accepted} images in {len(rows)} buckets from {root} ({reopened} files read)")
    ctx.log.info("scan: %d accepted, %d rejected, %d buckets, %d files read", accepted, len(rejected), len(rows),
                 reopened)
    for r in rejected[:20]:
        ctx.log.warning("scan: rejected %s: %s", r.path, r.reason)
    if len(rejected) > 20:
        ctx.log.warning("scan: ... and %d more rejected (see rejected.jsonl)", len(rejected) - 20)
