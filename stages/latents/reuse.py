"""Incremental builds: rows of the previous published version whose content key matches are reused: a block
that matches one of the previous version's blocks row for row shares its chunk files, other rows are copied.

A row's key hashes everything its latents depend on (image bytes, bucket, crop, background, VAE identity,
VAE and stored dtypes, flip, pixel pipeline version), so a match means encoding would give the same row.
Only the latest published version is consulted, after the artifact store has verified its files.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from tuneline.schemas.latents import LatentsManifest
from tuneline.schemas.scan import ImageRecord
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.stage import reusable_previous
from tuneline.stages.latents import store
from tuneline.stages.latents.writer import Link

# Bump when to_pixels changes what an image becomes (filter, value range): old rows stop matching.
PIXELS_VERSION = 1
# Copies walk the previous version mostly in row order; a few blocks cover the look-ahead of the writer.
CACHED_BLOCKS = 8


def row_identity(vae_identity: str, vae_dtype: str, dtype: str, flip: bool) -> dict:
    """What every row of a build shares; row_key adds the per-image part."""
    return {"vae": vae_identity, "vae_dtype": vae_dtype, "dtype": dtype, "flip": flip, "pixels": PIXELS_VERSION}


def row_key(rec: ImageRecord, identity: dict) -> str:
    return digest(
        {
            "sha256": rec.sha256,
            "bucket": [rec.bucket_width, rec.bucket_height],
            "crop": list(rec.crop),
            "background": rec.background,
            # A clip's frames: which part of the file at which rate (absent for images, whose keys stay as they were).
            **({"clip": [rec.frames, rec.fps, rec.start]} if rec.start is not None else {}),
            **identity,
        },
        length=32,
    )


class PreviousRows:
    """Rows of one published version by key (tuneline.stages.latents.writer.Reuse), read a whole block at a time."""

    def __init__(self, path: Path, manifest: LatentsManifest, names: tuple[str, ...]):
        self.dir, self.names, self.block_rows = path, names, manifest.block_rows
        self.where = {row["key"]: (row["bucket"], row["row"]) for row in read_jsonl(path / store.INDEX)}
        self.fingerprint = manifest.fingerprint
        self._arrays: dict[str, dict] = {}
        self._blocks: OrderedDict[tuple[str, int], dict[str, np.ndarray]] = OrderedDict()

    @classmethod
    def latest(cls, ctx, names: tuple[str, ...]) -> PreviousRows | None:
        found = reusable_previous(ctx, "latents", LatentsManifest)
        if found is None:
            return None
        path, manifest = found
        if not set(names) <= set(store.array_names(manifest.flip)):
            return None
        return cls(path, manifest, names)

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def rows(self, key: str) -> dict[str, np.ndarray]:
        bucket, row = self.where[key]
        block, offset = divmod(row, self.block_rows)
        return {name: arr[offset] for name, arr in self._block(bucket, block).items()}

    def link(self, keys: list[str], block_rows: int) -> Link | None:
        """The previous block whose rows are exactly `keys`, in order (its record says so), with the record's digest,
        when its chunk files can be shared. A short `keys` (a bucket's last block) matches only a short block."""
        first = self.where.get(keys[0]) if keys and block_rows == self.block_rows else None
        if first is None or first[1] % block_rows:
            return None
        bucket, block = first[0], first[1] // block_rows
        record = store.read_record(self.dir, bucket, block)
        if record is None or record.get("keys") != keys:
            return None
        arrays = self._open(bucket)
        return Link(arrays, block, record["digest"]) if all(store.can_link(a) for a in arrays.values()) else None

    def _open(self, bucket: str) -> dict:
        if bucket not in self._arrays:
            self._arrays[bucket] = store.open_arrays(self.dir, bucket, self.names)
        return self._arrays[bucket]

    def _block(self, bucket: str, block: int) -> dict[str, np.ndarray]:
        at = (bucket, block)
        if at not in self._blocks:
            self._blocks[at] = store.read_blocks(self._open(bucket), block)
            if len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        self._blocks.move_to_end(at)
        return self._blocks[at]
