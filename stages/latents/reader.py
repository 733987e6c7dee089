"""Training reader for the latent cache: bucket-aware batches, block reads, disjoint rank shards.

Every global batch comes from one bucket and holds batch_size x world_size rows; rank r takes slice r, so
ranks never share a row within an epoch (except when a bucket smaller than a global batch is repeated to
fill it). The plan depends only on (seed, epoch, bucket counts, block size), so every rank computes the same
plan without talking.

Shuffling is block-aware, so the reader reads each block once per epoch instead of one block per row: the
blocks of a bucket are permuted, grouped into windows of WINDOW_BLOCKS blocks, and the rows of each window
are permuted; buckets are interleaved at random but each keeps its own order. A reader of a remote cache therefore
holds at most 2 x WINDOW_BLOCKS blocks per bucket in memory; a local cache's chunk files stay memory-mapped
(up to MAPPED_BYTES), so a later epoch reads pages the process already maps.

The cache may be a local version directory or a pushed version's fsspec URL (Remote.version_url, with
Remote.options as storage_options): then every block read is one GET per array, and the training feed's threads
(tuneline.stages.train.loop.Trainer.feed) keep several in flight. Verify a remote manifest with
tuneline.stages.common.remote.read_remote_manifest before reading.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tuneline.schemas.latents import LatentsManifest
from tuneline.stages.common.artifacts import fix_hint
from tuneline.stages.latents import store

WINDOW_BLOCKS = 4
# Local blocks stay mapped, up to this many bytes (1,024 blocks of SD1.5's 4x64x64 float16 mean + std) and blocks
# (a mapping per array: well under Linux's 65,530 per process) per reader: mapping a chunk file anew every epoch
# costs a page fault per 4 KiB on first touch, a third of the training feed's time on a CPU (bench/loader.py).
# Mapped pages are the page cache's: the kernel can reclaim them.
MAPPED_BYTES, MAPPED_BLOCKS = 4 << 30, 8192
DEFAULT_BLOCK_ROWS = 64  # LatentsConfig.block_rows' default


class ReaderError(RuntimeError):
    pass


@dataclass(frozen=True)
class Batch:
    bucket: str
    rows: tuple[int, ...]
    paths: tuple[str, ...]
    flip: tuple[bool, ...] | None = None  # per row: read the flipped variant (needs a cache built with flip)


def block_shuffle(n: int, block_rows: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of range(n): blocks in random order, rows shuffled within each window of blocks."""
    blocks = rng.permutation(-(-n // block_rows))
    parts = []
    for i in range(0, len(blocks), window):
        rows = np.concatenate([np.arange(b * block_rows, min(n, (b + 1) * block_rows)) for b in blocks[i : i + window]])
        parts.append(rng.permutation(rows))
    return np.concatenate(parts)


def epoch_plan(
    counts: dict[str, int],
    batch_size: int,
    world_size: int,
    seed: int,
    epoch: int,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
    window: int = WINDOW_BLOCKS,
) -> list[tuple[str, np.ndarray]]:
    """Global batches for one epoch: (bucket, row ids of length batch_size * world_size).

    A bucket too small for a global batch is repeated to fill it rather than dropped; a bucket's remainder
    (fewer rows than a global batch) sits out this epoch, a different remainder each epoch.
    """
    rng = np.random.default_rng([seed, epoch])
    gb = batch_size * world_size
    per_bucket: dict[str, list[np.ndarray]] = {}
    for bucket in sorted(counts):
        n = counts[bucket]
        if n == 0:
            continue
        rows = block_shuffle(n, block_rows, window, rng)
        if n < gb:
            rows = np.resize(rows, gb)  # repeats the permutation cyclically
        per_bucket[bucket] = [rows[i : i + gb] for i in range(0, len(rows) // gb * gb, gb)]
    labels = [b for b, batches in per_bucket.items() for _ in batches]
    taken = dict.fromkeys(per_bucket, 0)
    plan = []
    for i in rng.permutation(len(labels)):  # random interleave; each bucket keeps its block order
        b = labels[i]
        plan.append((b, per_bucket[b][taken[b]]))
        taken[b] += 1
    return plan


class LatentReader:
    """Reads the cache a block at a time and samples latent = mean + std * eps."""

    def __init__(self, artifact_dir: Path | str, manifest: LatentsManifest, *, storage_options: dict | None = None):
        self.dir = artifact_dir if store.is_url(artifact_dir) else Path(artifact_dir)
        self.manifest, self.options = manifest, storage_options
        self.block_rows = manifest.block_rows
        self.shapes = {b.array: tuple(b.shape) for b in manifest.buckets}
        self.names = store.array_names(manifest.flip)
        self.paths = self._index()
        self.arrays = {b.array: self._open(b) for b in manifest.buckets}
        self._blocks: dict[str, OrderedDict[int, dict[str, np.ndarray]]] = {b: OrderedDict() for b in self.shapes}
        remote = store.is_url(self.dir)
        self._keep = {
            b: 2 * WINDOW_BLOCKS if remote else max(2 * WINDOW_BLOCKS, self._mapped_blocks(b)) for b in self.shapes
        }  # blocks held per bucket
        self._lock = threading.Lock()

    def _mapped_blocks(self, bucket: str) -> int:
        """How many blocks of `bucket` a local reader keeps mapped: its share of MAPPED_BYTES and MAPPED_BLOCKS."""
        share = max(1, len(self.shapes))
        block_bytes = (
            self.block_rows
            * int(np.prod(self.shapes[bucket]))
            * len(self.names)
            * np.dtype(self.manifest.dtype).itemsize
        )
        return min(MAPPED_BLOCKS // share, MAPPED_BYTES // share // block_bytes)

    def _fail(self, what: str) -> ReaderError:
        return ReaderError(f"latent cache {self.dir}: {what}; {fix_hint('latents')}")

    def _index(self) -> dict[str, list[str]]:
        """Row -> image path per bucket; every row of every bucket exactly once, as the manifest counts."""
        paths: dict[str, list[str | None]] = {b.array: [None] * b.count for b in self.manifest.buckets}
        for row in store.read_index(self.dir, self.options):
            col = paths.get(row["bucket"])
            if col is None or not 0 <= row["row"] < len(col) or col[row["row"]] is not None:
                raise self._fail(f"index row {row} does not fit the manifest's buckets")
            col[row["row"]] = row["path"]
        missing = [f"{b} row {col.index(None)}" for b, col in paths.items() if None in col]
        if missing:
            raise self._fail(f"index lacks {', '.join(missing[:3])}")
        return paths  # type: ignore[return-value]

    def _open(self, b) -> dict:
        arrays = store.open_arrays(self.dir, b.array, self.names, self.options)
        want = ((b.count, *b.shape), (self.block_rows, *b.shape), self.manifest.dtype)
        for name, arr in arrays.items():
            problem = store.raw_layout_problem(arr)
            if problem:
                raise self._fail(f"bucket {b.array} array {name} cannot be read block-wise: {problem}")
            got = (tuple(arr.shape), tuple(arr.chunks), str(arr.dtype))
            if got != want:
                raise self._fail(
                    f"bucket {b.array} array {name} is {got[0]} {got[2]} in chunks of {got[1][0]} "
                    f"rows, the manifest says {want[0]} {want[2]} in chunks of {want[1][0]}"
                )
        return arrays

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.paths.items()}

    def plan(self, batch_size: int, world_size: int, seed: int, epoch: int) -> list[tuple[str, np.ndarray]]:
        """epoch_plan with this cache's block size."""
        return epoch_plan(self.counts(), batch_size, world_size, seed, epoch, block_rows=self.block_rows)

    def batch(self, bucket: str, rows: np.ndarray, flip: Iterable[bool] | None = None) -> Batch:
        flip = None if flip is None else tuple(bool(f) for f in flip)
        if flip is not None and any(flip) and not self.manifest.flip:
            raise self._fail(
                "a flipped batch was asked for but the cache holds no flipped variant (set latents.flip true)"
            )
        return Batch(bucket, tuple(int(r) for r in rows), tuple(self.paths[bucket][int(r)] for r in rows), flip)

    def _block(self, bucket: str, block: int) -> dict[str, np.ndarray]:
        cache = self._blocks[bucket]
        with self._lock:
            if block in cache:
                cache.move_to_end(block)
                return cache[block]
        try:
            data = {name: store.read_chunk(arr, block) for name, arr in self.arrays[bucket].items()}
        except (OSError, ValueError) as err:
            raise self._fail(f"bucket {bucket} block {block}: {err}") from None
        for name, arr in data.items():  # once per block read: cheap, and it catches a store edited since open
            if arr.shape[1:] != self.shapes[bucket] or str(arr.dtype) != self.manifest.dtype:
                raise self._fail(
                    f"bucket {bucket} block {block} of {name} reads as {arr.shape[1:]} {arr.dtype}, "
                    f"the manifest says {self.shapes[bucket]} {self.manifest.dtype}"
                )
        with self._lock:
            cache[block] = data
            while len(cache) > self._keep[bucket]:
                cache.popitem(last=False)
        return data

    def gather(self, batch: Batch, *, pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of the batch's rows, (B, C, h, w) in the stored dtype, read a block at a time. pin: written
        straight into page-locked memory, so a copy to the GPU can run asynchronously without another copy."""
        rows = np.asarray(batch.rows, dtype=np.int64)
        flip = np.zeros(len(rows), bool) if batch.flip is None else np.asarray(batch.flip, dtype=bool)
        shape, count = self.shapes[batch.bucket], len(self.paths[batch.bucket])
        if len(flip) != len(rows) or rows.min(initial=0) < 0 or rows.max(initial=0) >= count:
            raise ReaderError(
                f"batch of bucket {batch.bucket} asks for rows {list(rows[:8])} (flip "
                f"{batch.flip}); the bucket has rows 0..{count - 1}"
            )
        dtype = getattr(torch, self.manifest.dtype)
        mean_t, std_t = (torch.empty((len(rows), *shape), dtype=dtype, pin_memory=pin) for _ in range(2))
        mean, std = mean_t.numpy(), std_t.numpy()
        blocks = rows // self.block_rows
        variants = ((False, store.DIST), (True, store.FLIPPED)) if flip.any() else ((False, store.DIST),)
        for block in np.unique(blocks):
            data = self._block(batch.bucket, int(block))
            for flipped, (m, s) in variants:
                at = np.flatnonzero((blocks == block) & (flip == flipped))
                if len(at):
                    offsets = rows[at] - block * self.block_rows
                    mean[at], std[at] = data[m][offsets], data[s][offsets]
        return mean_t, std_t

    def sample(self, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        """mean + std * eps, on the generator's device, with eps drawn from `generator`."""
        return draw(*self.gather(batch), generator)


def draw(mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """float32 mean + std * eps on the generator's device.

    In place on eps with the stored (float16) operands: no float32 copies of mean and std are made, which
    on a CPU costs about as much as drawing eps.
    """
    dev = generator.device
    eps = torch.randn(mean.shape, generator=generator, device=dev)
    return eps.mul_(std.to(dev, non_blocking=True)).add_(mean.to(dev, non_blocking=True))
