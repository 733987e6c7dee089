"""Bucket bookkeeping after sizing: the small-bucket plan, duplicates and the bucket table.

The plan is a pure function of bucket counts and the global batch, so the trainer can call the same
`bucket_plan` with its own batch; the scan applies it only to report it, and (with `drop`) to drop buckets.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from tuneline.schemas.scan import BucketRow, ImageRecord, Rejected

SAMPLES = 3
# (width, height), and a video family's frame count after them: (width, height, frames).
Bucket = tuple[int, ...]


class NoBatchError(ValueError):
    """No bucket can form one batch; the message names the buckets and the settings to change."""


def bucket_plan(counts: dict[Bucket, int], batch: int, policy: str) -> dict[Bucket, int]:
    """bucket -> how many times its images are repeated per epoch (0 = dropped)."""
    if not counts:
        raise NoBatchError("no image was accepted, so no batch can be formed")
    if policy == "repeat":
        plan = {b: max(1, math.ceil(batch / n)) for b, n in counts.items()}
    elif policy == "drop":
        plan = {b: (1 if n >= batch else 0) for b, n in counts.items()}
    else:
        raise ValueError(f"buckets.small_bucket: unknown policy {policy!r}; use repeat or drop")
    if not any(plan.values()):
        bucket, n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        raise NoBatchError(
            f"no bucket can form a batch of {batch} (train.batch_size x train.processes x "
            f"train.nodes): the largest, {name(bucket)}, has {n} images and buckets.small_bucket is "
            f"drop; set buckets.small_bucket: repeat, lower train.batch_size, or add images"
        )
    return plan


def bucket_of(r: ImageRecord) -> Bucket:
    return (r.bucket_width, r.bucket_height) if r.frames is None else (r.bucket_width, r.bucket_height, r.frames)


def name(bucket: Bucket) -> str:
    """64x48, or 64x48x17f for a video family's bucket of 17-frame clips."""
    return "x".join(map(str, bucket[:2])) + (f"x{bucket[2]}f" if len(bucket) > 2 else "")


def by_bucket(records: list[ImageRecord]) -> dict[Bucket, list[ImageRecord]]:
    groups: dict[Bucket, list[ImageRecord]] = defaultdict(list)
    for r in records:
        groups[bucket_of(r)].append(r)
    return dict(sorted(groups.items()))


def apply_plan(
    records: list[ImageRecord], plan: dict[Bucket, int], batch: int
) -> tuple[list[ImageRecord], list[Rejected], list[BucketRow]]:
    """Split records into kept / rejected (dropped buckets) and build the bucket table."""
    kept, dropped, rows = [], [], []
    for bucket, recs in by_bucket(records).items():
        rows.append(
            BucketRow(
                width=bucket[0],
                height=bucket[1],
                frames=bucket[2] if len(bucket) > 2 else None,
                count=len(recs),
                samples=[r.ref for r in recs[:SAMPLES]],
                dropped=plan[bucket] == 0,
            )
        )
        if plan[bucket]:
            kept += recs
            continue
        dropped += [
            Rejected(
                path=r.ref,
                kind="small-bucket",
                reason=f"bucket {name(bucket)} has {len(recs)} images, fewer than one batch of {batch}, and "
                f"buckets.small_bucket is drop; set it to repeat to keep them",
            )
            for r in recs
        ]
    return sorted(kept, key=lambda r: r.ref), dropped, rows


def duplicate_groups(records: list[ImageRecord]) -> list[list[str]]:
    groups: dict[str, set[str]] = defaultdict(set)
    for r in records:
        groups[r.sha256].add(r.ref)  # a set: with buckets.resolutions one image has a record per resolution
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def reject_duplicates(records: list[ImageRecord], groups: list[list[str]]) -> tuple[list[ImageRecord], list[Rejected]]:
    """Keep the first path of each identical-content group."""
    later = {p: g[0] for g in groups for p in g[1:]}
    rejected = [
        Rejected(path=p, kind="duplicate", reason=f"same content as {first}; dataset.duplicates is reject")
        for p, first in sorted(later.items())
    ]
    return [r for r in records if r.ref not in later], rejected


def table(rows: list[BucketRow], plan: dict[Bucket, int]) -> list[dict]:
    """The bucket table as the Prefect table artifact shows it."""
    keys = [(r.width, r.height) if r.frames is None else (r.width, r.height, r.frames) for r in rows]
    return [
        {
            "bucket": name(key),
            "count": r.count,
            "repeats": plan[key],
            "status": "dropped" if r.dropped else "kept",
            "samples": ", ".join(r.samples),
        }
        for r, key in zip(rows, keys)
    ]


def conversions(records: list[ImageRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.conversion for r in records if r.conversion).items()))
