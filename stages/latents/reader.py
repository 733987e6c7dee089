"""Training reader for the latent cache: bucket-aware batches, block reads, disjoint rank shards.

Every global batch comes from one bucket and holds batch_size x world_size rows; rank r takes slice r.
The plan depends only on (seed, epoch, bucket counts), so every rank computes the same plan without talking.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from schemas.latents import LatentsManifest
from stages.common.jsonl import read_jsonl
from stages.latents import store


class ReaderError(RuntimeError):
    pass


@dataclass(frozen=True)
class Batch:
    bucket: str
    rows: tuple[int, ...]
    paths: tuple[str, ...]


def epoch_plan(counts: dict[str, int], batch_size: int, world_size: int, seed: int,
               epoch: int) -> list[tuple[str, np.ndarray]]:
    """Global batches for one epoch: (bucket, row ids of length batch_size * world_size).

    Rows are shuffled within each bucket; a bucket too small for a global batch is repeated to fill it
    rather than dropped; the order of batches across buckets is shuffled too.
    """
    rng = np.random.default_rng([seed, epoch])
    gb = batch_size * world_size
    plan: list[tuple[str, np.ndarray]] = []
    for bucket in sorted(counts):
        n = counts[bucket]
        if n == 0:
            continue
        rows = rng.permutation(n)
        if n < gb:
            rows = np.resize(rows, gb)  # repeats the permutation cyclically
        usable = len(rows) // gb * gb
        plan += [(bucket, rows[i:i + gb]) for i in range(0, usable, gb)]
    order = rng.permutation(len(plan))
    return [plan[i] for i in order]


class LatentReader:
    """Reads the cache one bucket block at a time and samples latent = mean + std * eps."""

    def __init__(self, artifact_dir: Path, manifest: LatentsManifest):
        self.dir = Path(artifact_dir)
        self.manifest = manifest
        self.paths: dict[str, list[str]] = {b.array: [""] * b.count for b in manifest.buckets}
        for row in read_jsonl(self.dir / store.INDEX):
            self.paths[row["bucket"]][row["row"]] = row["path"]
        self.shapes = {b.array: tuple(b.shape) for b in manifest.buckets}
        self._cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for b in manifest.buckets:  # check shapes/dtypes against the manifest when opened
            group = store.open_bucket(self.dir, b.width, b.height)
            arr = group["mean"]
            if tuple(arr.shape) != (b.count, *b.shape) or str(arr.dtype) != manifest.dtype:
                raise ReaderError(f"latent cache {self.dir}: bucket {b.array} holds {tuple(arr.shape)} "
                                  f"{arr.dtype}, the manifest says {(b.count, *b.shape)} {manifest.dtype}; "
                                  f"rebuild it with `tuneline stage latents --force`")

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.paths.items()}

    def _bucket(self, bucket: str) -> tuple[np.ndarray, np.ndarray]:
        if bucket not in self._cache:
            b = next(x for x in self.manifest.buckets if x.array == bucket)
            group = store.open_bucket(self.dir, b.width, b.height)
            self._cache[bucket] = store.read_block(group, 0, b.count)
        return self._cache[bucket]

    def batch(self, bucket: str, rows: np.ndarray) -> Batch:
        return Batch(bucket, tuple(int(r) for r in rows), tuple(self.paths[bucket][int(r)] for r in rows))

    def sample(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        mean, std = self._bucket(batch.bucket)
        idx = np.asarray(batch.rows)
        m = torch.from_numpy(mean[idx].astype(np.float32))
        s = torch.from_numpy(std[idx].astype(np.float32))
        if tuple(m.shape[1:]) != self.shapes[batch.bucket]:
            raise ReaderError(f"latent batch from bucket {batch.bucket} has shape {tuple(m.shape[1:])}, expected "
                              f"{self.shapes[batch.bucket]} (images {batch.paths[:3]})")
        eps = torch.randn(m.shape, generator=generator)
        return m + s * eps
