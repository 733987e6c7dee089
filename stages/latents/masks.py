"""Loss masks at the latent grid, cached beside the latents: `masks/<bucket>.npy`, one (h, w) plane per row.

Each mask gets the crop its image got and is area-averaged down to the latent grid, so a latent position weighs
what share of its pixels the mask keeps. The flipped variant is the same plane mirrored (the reader does that).
Rows without a mask are all ones.
"""

from __future__ import annotations

import hashlib
import io
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tuneline.schemas.scan import ImageRecord, Location
from tuneline.stages.latents.store import bucket_key, open_npy
from tuneline.stages.scan.images import TRANSPOSE
from tuneline.stages.scan.members import open_image, read_ranges

FOLDER = "masks"
READ_ROWS = 64  # rows whose shard members are read together: in a few sequential reads, a bounded memory


def mask_file(artifact_dir: Path, bucket: str) -> Path:
    return Path(artifact_dir) / FOLDER / f"{bucket}.npy"


def _plane(
    rec: ImageRecord,
    image_root: Path | Location,
    mask_root: Path | None,
    grid: tuple[int, int],
    *,
    data: bytes | None = None,
) -> np.ndarray:
    """One record's mask cropped and averaged down to the (h, w) latent grid, values in [0, 1]. `data`: the bytes
    of the shard member holding it, read with its neighbours' (_span)."""
    if rec.mask_kind is None:
        return np.ones(grid, np.float16)
    if rec.mask_kind == "alpha":  # a file, or a shard's member
        with Image.open(io.BytesIO(data) if data is not None else open_image(image_root, rec)) as im:
            mask = im.convert("RGBA").getchannel("A")
        if rec.orientation in TRANSPOSE:
            mask = mask.transpose(TRANSPOSE[rec.orientation])
    else:  # a mask file, or the sample's mask member
        if data is not None and hashlib.sha256(data).hexdigest() != rec.mask_sha256:
            raise ValueError(
                f"mask member {rec.mask_path} of {rec.path} changed since the scan (content hash differs): run "
                f"`tuneline run --until latents` (it rescans, then caches the new mask)"
            )
        with Image.open(mask_root / rec.mask_path if data is None else io.BytesIO(data)) as im:
            mask = im.convert("L")
    if mask.size != (rec.width, rec.height):
        raise ValueError(
            f"mask of {rec.path} is {mask.size[0]}x{mask.size[1]}, the scan recorded "
            f"{rec.width}x{rec.height}: the file changed since the scan; run `tuneline stage scan`"
        )
    # Float before averaging: an 8-bit average would round a half-covered position to 128 / 255.
    small = mask.crop(rec.crop).convert("F").resize((grid[1], grid[0]), Image.Resampling.BOX)
    return (np.asarray(small, np.float32) / 255.0).astype(np.float16)


def _span(rec: ImageRecord) -> tuple[str, int, int] | None:
    """(shard, offset, size) of the webdataset member a record's mask is read from; None for files and tables."""
    if rec.mask_kind == "member":
        return rec.shard, rec.mask_offset, rec.mask_size_bytes
    if rec.mask_kind == "alpha" and rec.offset is not None:
        return rec.shard, rec.offset, rec.size_bytes
    return None


def _members(recs: list[ImageRecord], roots: dict[int | None, Path | Location]) -> dict[tuple, bytes]:
    """The mask members of these records by (source, shard, offset), each shard's read in a few sequential reads
    (read_ranges), not one request per member."""
    wanted: dict[int | None, list[tuple[str, int, int]]] = defaultdict(list)
    for r in recs:
        if (span := _span(r)) is not None:
            wanted[r.source].append(span)
    return {(src, *k): v for src, spans in wanted.items() for k, v in read_ranges(roots[src], spans).items()}


def write_masks(
    work: Path,
    index: list[dict],
    records: list[ImageRecord],
    roots: dict[int | None, Path | Location],
    mask_root: Path | None,
    vae_factor: int,
) -> int:
    """Write every bucket's masks when any cached image has one; returns how many rows have a mask."""
    sized = {(r.ref, bucket_key(r.bucket_width, r.bucket_height, r.frames)): r for r in records}
    rows = [row for row in index if sized[row["path"], row["bucket"]].mask_kind is not None]
    if not rows:
        return 0
    buckets: dict[str, list[dict]] = defaultdict(list)
    for row in index:
        buckets[row["bucket"]].append(row)
    (work / FOLDER).mkdir(exist_ok=True)
    for bucket, members in buckets.items():
        first = sized[members[0]["path"], bucket]
        grid = (first.bucket_height // vae_factor, first.bucket_width // vae_factor)
        planes = np.ones((len(members), *grid), np.float16)
        members = sorted(members, key=lambda row: row["row"])
        for part in (members[i : i + READ_ROWS] for i in range(0, len(members), READ_ROWS)):
            recs = [sized[row["path"], bucket] for row in part]
            data = _members(recs, roots)
            for row, rec in zip(part, recs, strict=True):
                got = data.get((rec.source, *span[:2])) if (span := _span(rec)) else None
                planes[row["row"]] = _plane(rec, roots[rec.source], mask_root, grid, data=got)
        np.save(mask_file(work, bucket), planes)
    return len(rows)


@lru_cache(maxsize=64)
def _planes(artifact_dir: str, bucket: str) -> np.ndarray:
    return open_npy(mask_file(Path(artifact_dir), bucket))


def read(reader, batch) -> torch.Tensor | None:
    """(B, 1, h, w) float32 masks of a reader batch (mirrored for flipped rows); None when no image has one."""
    if not reader.manifest.masked:
        return None
    planes = np.array(_planes(str(reader.dir), batch.bucket)[list(batch.rows)], np.float32)
    for i, flipped in enumerate(batch.flip or ()):
        if flipped:
            planes[i] = planes[i][:, ::-1]
    return torch.from_numpy(planes).unsqueeze(1)
