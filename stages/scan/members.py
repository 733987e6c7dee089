"""Reading one image of a webdataset shard or a parquet table by its scan record, wherever the shard lives.

A shard member is a byte range (the record's offset and size; a sample's mask and control members have theirs): one ranged read, no extraction to disk, no
download of the whole shard. A parquet image is read with its row group's image column (parquet compresses
column chunks, so a row has no byte range of its own); the last few row groups are kept, since a bucket's
images come from the same row groups.
"""

from __future__ import annotations

import hashlib
import io
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from tuneline.schemas.scan import ImageRecord, Location
from tuneline.stages.common.artifacts import safe_join
from tuneline.stages.common.hashing import file_sha256
from tuneline.stages.scan.shardfs import shard_location

ROW_GROUPS_KEPT = 8
# Members read together (read_ranges): ranges less than GAP apart are one read, of MOST bytes at most.
GAP = 1 << 20
MOST = 64 << 20


def image_source(root: Path | Location, rec: ImageRecord) -> tuple[str, Path | io.BytesIO]:
    """(SHA-256 of the image's bytes as read now, something `load_rgb` opens) for any record."""
    if rec.shard is None:
        path = safe_join(root, rec.path)
        return file_sha256(path), path
    data = member_bytes(root, rec)
    return hashlib.sha256(data).hexdigest(), io.BytesIO(data)


def open_image(root: Path | Location, rec: ImageRecord) -> Path | io.BytesIO:
    """What `load_rgb` opens for any record, unhashed (the caption stage keys by the scan's hash)."""
    return safe_join(root, rec.path) if rec.shard is None else io.BytesIO(member_bytes(root, rec))


def member_bytes(root: Path | Location, rec: ImageRecord) -> bytes:
    if rec.offset is not None:
        return range_bytes(root, rec.shard, rec.offset, rec.size_bytes, rec.path)
    fs, path = shard_location(root, rec.shard)
    cells = _row_group(fs, path, rec.row_group, rec.column)
    if rec.row >= len(cells):
        raise OSError(f"row group {rec.row_group} of {path} has no row {rec.row} (the table changed since the scan)")
    cell = cells[rec.row]
    return cell.get("bytes") if isinstance(cell, dict) else cell


def range_bytes(root: Path | Location, shard: str, offset: int, size: int, name: str) -> bytes:
    """One member's bytes (an image, or a sample's mask or control member: stages/scan/samples.py) by its range."""
    fs, path = shard_location(root, shard)
    data = fs.cat_file(path, start=offset, end=offset + size)
    if len(data) != size:
        raise OSError(f"shard {path} ends inside member {name} (the shard changed since the scan)")
    return data


def coalesce(spans: list[tuple[int, int]], gap: int = GAP, most: int = MOST) -> list[tuple[int, int]]:
    """(start, end) of the reads that cover these (offset, size) ranges: sorted, and merged where the next range
    starts less than `gap` after the read's end and the read stays under `most` bytes."""
    out: list[tuple[int, int]] = []
    for offset, size in sorted(spans):
        if out and offset - out[-1][1] < gap and offset + size - out[-1][0] <= most:
            out[-1] = (out[-1][0], max(out[-1][1], offset + size))
        else:
            out.append((offset, offset + size))
    return out


def read_ranges(root: Path | Location, ranges: list[tuple[str, int, int]]) -> dict[tuple[str, int], bytes]:
    """Members' bytes by (shard, offset), from (shard, offset, size) ranges: each shard's in a few sequential reads
    (`coalesce`), not one request per member, which on object storage costs a round trip each."""
    by_shard: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for shard, offset, size in ranges:
        by_shard[shard].add((offset, size))
    out = {}
    for shard, spans in by_shard.items():
        reads = coalesce(list(spans))
        data = {start: range_bytes(root, shard, start, end - start, f"bytes {start}-{end}") for start, end in reads}
        starts = [start for start, _ in reads]
        for offset, size in spans:
            start = starts[bisect_right(starts, offset) - 1]
            out[shard, offset] = data[start][offset - start : offset - start + size]
    return out


def control_bytes(root: Path | Location, rec: ImageRecord) -> bytes:
    """A record's control member (its sample's key.control.<ext>), checked against the scan's content hash."""
    data = range_bytes(root, rec.shard, rec.control_offset, rec.control_size_bytes, rec.control_path)
    if hashlib.sha256(data).hexdigest() != rec.control_sha256:
        raise ValueError(
            f"control member {rec.control_path} of {rec.path} changed since the scan (content hash differs): run "
            f"`tuneline run --until latents` (it rescans, then caches the new control)"
        )
    return data


@dataclass(frozen=True)
class ControlMember:
    """A record's control member, named and read like a control file by the text and validate stages."""

    root: Path | Location
    rec: ImageRecord

    def read_bytes(self) -> bytes:
        return control_bytes(self.root, self.rec)

    def __str__(self) -> str:
        return f"{str(self.root).rstrip('/')}/{self.rec.control_path}"


def control_file(roots: dict[int | None, Path | Location], rec: dict) -> Path | ControlMember:
    """Where a scan record (as JSON) has its control: a file or a folder of references under its control folder,
    or its sample's control member (`roots`: ScanManifest.control_sources())."""
    root = roots[rec.get("source")]
    if rec.get("control_offset") is None:
        return root / rec["control_path"]
    return ControlMember(root, ImageRecord.model_validate(rec))


@lru_cache(maxsize=ROW_GROUPS_KEPT)
def _row_group(fs, path: str, row_group: int, column: str) -> list:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as f:
        return pq.ParquetFile(f).read_row_group(row_group, columns=[column]).column(column).to_pylist()
