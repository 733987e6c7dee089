"""Bucket bookkeeping after sizing: the small-bucket plan, duplicates and the bucket table.

The plan is a pure function of bucket counts and the global batch, so the trainer can call the same
`bucket_plan` with its own batch; the scan applies it only to report it, and (with `drop`) to drop buckets.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from tuneline.schemas.scan import BucketRow, ImageRecord, Rejected

SAMPLES = 3
Bucket = tuple[int, int]


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
        (bw, bh), n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        raise NoBatchError(
            f"no bucket can form a batch of {batch} (train.batch_size x train.processes x "
            f"train.nodes): the largest, {bw}x{bh}, has {n} images and buckets.small_bucket is "
            f"drop; set buckets.small_bucket: repeat, lower train.batch_size, or add images"
        )
    return plan


def by_bucket(records: list[ImageRecord]) -> dict[Bucket, list[ImageRecord]]:
    groups: dict[Bucket, list[ImageRecord]] = defaultdict(list)
    for r in records:
        groups[(r.bucket_width, r.bucket_height)].append(r)
    return dict(sorted(groups.items()))


def apply_plan(
    records: list[ImageRecord], plan: dict[Bucket, int], batch: int
) -> tuple[list[ImageRecord], list[Rejected], list[BucketRow]]:
    """Split records into kept / rejected (dropped buckets) and build the bucket table."""
    kept, dropped, rows = [], [], []
    for (bw, bh), recs in by_bucket(records).items():
        rows.append(
            BucketRow(
                width=bw,
                height=bh,
                count=len(recs),
                samples=[r.ref for r in recs[:SAMPLES]],
                dropped=plan[(bw, bh)] == 0,
            )
        )
        if plan[(bw, bh)]:
            kept += recs
            continue
        dropped += [
            Rejected(
                path=r.ref,
                kind="small-bucket",
                reason=f"bucket {bw}x{bh} has {len(recs)} images, fewer than one batch of {batch}, and "
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
    return [
        {
            "bucket": f"{r.width}x{r.height}",
            "count": r.count,
            "repeats": plan[(r.width, r.height)],
            "status": "dropped" if r.dropped else "kept",
            "samples": ", ".join(r.samples),
        }
        for r in rows
    ]


def conversions(records: list[ImageRecord]) -> dict[str, int]:
    return dict(sorted(Counter(r.conversion for r in records if r.conversion).items()))
