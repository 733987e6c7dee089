"""Writing one bucket block by block: resume finished blocks, reuse unchanged rows, encode the rest.

A block is `block_rows` consecutive rows. It is assembled in memory (rows copied from the previous version
and rows encoded now), written as one chunk per array, then recorded in `blocks/`. A block that equals a
block of the previous version row for row (the common case when a folder grows: buckets without new images,
and the blocks before the first new image of a bucket) shares that block's chunk files instead, so an
incremental build costs what changed, not the cache's size. Decoding runs ahead in the worker pool while the
VAE encodes, so the VAE rarely waits for pixels. On a GPU the host should not hold the VAE up either: the next
batch starts before the host takes the last one's latents, and each block is written on a thread of its own while
the next is encoded (on an H200 at 1024², SDXL's VAE at 0.77 and 0.98 of the encoder's images/s alone in two
runs, FLUX.1's at 0.96; SD1.5's at 512² 0.73: bench/README.md). Within a block only: a block's last batch is taken
before the block is written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tuneline.schemas.latents import LatentsConfig
from tuneline.schemas.scan import ImageRecord, Rejected, ScanManifest
from tuneline.stages.latents import store
from tuneline.stages.latents.encode import prepare


@dataclass
class BucketJob:
    key: str  # "<W>x<H>"
    width: int
    height: int
    shape: tuple[int, int, int]
    records: list[ImageRecord]  # sorted by path: row order
    row_keys: list[str]  # content identity of each record's row
    frames: int | None = None  # a video family's bucket: its clips' frame count


@dataclass
class BucketResult:
    index: list[dict] = field(default_factory=list)  # {"path", "bucket", "row", "key"}
    rejected: list[Rejected] = field(default_factory=list)
    encoded: int = 0
    reused: int = 0
    resumed: int = 0


@dataclass
class Settings:
    roots: dict[int | None, Path]  # record.source -> the folder its path is relative to
    work: Path  # the version's work-in-progress directory
    dtype: str
    block_rows: int
    batch_size: int
    names: tuple[str, ...]  # arrays per bucket

    @classmethod
    def of(cls, scan: ScanManifest, work: Path, lc: LatentsConfig) -> Settings:
        """The settings the stage's config gives (the single process and every shard alike)."""
        return cls(scan.roots(), work, lc.dtype, lc.block_rows, lc.batch_size, store.array_names(lc.flip))


@dataclass(frozen=True)
class Link:
    """A block of the previous version whose chunk files a new block can share: its arrays, index and digest."""

    arrays: dict
    block: int
    digest: str


class Encode(Protocol):
    """The VAE side (tuneline.stages.latents.encode.Encoder): starts a batch, returns the call that waits for its
    checked arrays."""

    def submit(
        self, pixels: list[torch.Tensor], paths: list[str], expected: tuple[int, ...]
    ) -> Callable[[], dict[str, np.ndarray]]: ...


class Reuse(Protocol):
    """Rows of an earlier build by row key (tuneline.stages.latents.reuse.PreviousRows; NO_REUSE for a first build)."""

    def __contains__(self, key: str) -> bool: ...

    def rows(self, key: str) -> dict[str, np.ndarray]: ...

    def link(self, keys: list[str], block_rows: int) -> Link | None:
        """The earlier block that holds exactly these rows in this order, when a new block may share its files."""


class _NoReuse:
    def __contains__(self, key: str) -> bool:
        return False

    def rows(self, key: str) -> dict[str, np.ndarray]:
        raise KeyError(key)

    def link(self, keys: list[str], block_rows: int) -> Link | None:
        return None


NO_REUSE: Reuse = _NoReuse()


class BucketWriter:
    def __init__(self, s: Settings, job: BucketJob):
        self.s, self.job = s, job
        self.arrays: dict | None = None  # created with the first block: a bucket may end up empty
        self.blocks = 0
        self.first = 0  # the row out.index starts at: 0, or a shard's first block (at)
        self.out = BucketResult()
        self._io: ThreadPoolExecutor | None = None  # the writer thread, inside writing()
        self._pending: Future | None = None  # the block being written on it

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Blocks are written on a thread of their own, in order and one at a time, while the caller encodes the
        next. When the block exits every write has finished (a failed one raises here or at the next block)."""
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="latents-write") as self._io:
                yield
                self.wait()
        finally:
            self._io, self._pending = None, None  # after an error in the body: a write's own error goes with it

    def wait(self) -> None:
        """Until the block being written is on disk (its error, if it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write(self, write: Callable[[], None]) -> None:
        assert self._io is not None, "blocks are written inside writing() (fill_blocks)"
        self.wait()
        self._pending = self._io.submit(write)

    @property
    def rows(self) -> int:
        """Rows of the bucket before the next block."""
        return self.first + len(self.out.index)

    def at(self, block: int) -> None:
        """A shard's writer: the arrays exist (the parent made them), and writing starts at `block`."""
        self.arrays = store.open_arrays(self.s.work, self.job.key, self.s.names)
        self.blocks, self.first = block, block * self.s.block_rows

    def adopt(self, consumed: int) -> int:
        """A shard's own block `blocks`, finished by an earlier (killed) run, when it still checks out at record
        `consumed`: adopted, returns the records it covers; else 0 (the block is written again)."""
        rec = store.read_record(self.s.work, self.job.key, self.blocks)
        if rec is None:
            return 0
        n = len(rec["paths"]) + len(rec["rejected"])
        if not self._checks_out(rec, consumed, n):
            return 0
        self._adopt(rec["paths"], rec["keys"], [Rejected(**r) for r in rec["rejected"]])
        self.out.resumed += len(rec["paths"])
        return n

    def _ensure_arrays(self) -> dict:
        if self.arrays is None:
            j, s = self.job, self.s
            self.arrays = store.create_arrays(s.work, j.key, j.shape, len(j.records), s.dtype, s.block_rows, s.names)
        return self.arrays

    def resume(self) -> int:
        """Adopt the finished blocks of an interrupted build that still check out; returns records consumed."""
        consumed = 0
        for i, rec in enumerate(store.read_records(self.s.work, self.job.key)):
            n = len(rec["paths"]) + len(rec["rejected"])
            if not self._checks_out(rec, consumed, n):
                store.drop_records(self.s.work, self.job.key, i)  # this block and later ones are redone
                break
            self._adopt(rec["paths"], rec["keys"], [Rejected(**r) for r in rec["rejected"]])
            self.out.resumed += len(rec["paths"])
            consumed += n
        return consumed

    def _checks_out(self, rec: dict, consumed: int, n: int) -> bool:
        """The record covers the next records with the same row keys, and the data still has its digest."""
        j = self.job
        span = dict(zip((r.ref for r in j.records[consumed : consumed + n]), j.row_keys[consumed : consumed + n]))
        if (
            rec["start"] != self.rows
            or set(span) != set(rec["paths"]) | {r["path"] for r in rec["rejected"]}
            or [span.get(p) for p in rec["paths"]] != rec["keys"]
        ):
            return False
        start = self.rows
        data = store.read_arrays(self._ensure_arrays(), start, start + len(rec["paths"]))
        return store.block_digest(data) == rec["digest"]

    def _adopt(self, paths: list[str], keys: list[str], rejected: list[Rejected]) -> None:
        start = self.rows
        self.out.index += [
            {"path": p, "bucket": self.job.key, "row": start + i, "key": k} for i, (p, k) in enumerate(zip(paths, keys))
        ]
        self.out.rejected += rejected
        self.blocks += 1

    def commit(self, data: dict[str, np.ndarray], paths: list[str], keys: list[str], rejected: list[Rejected]) -> None:
        """Write a full block, then its record: until the record exists the block does not count."""
        start, block, arrays = self.rows, self.blocks, self._ensure_arrays()
        assert start == block * self.s.block_rows, "only a bucket's last block may be short"
        rejects = [r.model_dump(mode="json") for r in rejected]

        def write() -> None:
            store.write_block(arrays, block, data)
            digest = store.block_digest(data)
            record = {"start": start, "paths": paths, "keys": keys, "digest": digest, "rejected": rejects}
            store.write_record(self.s.work, self.job.key, block, record)

        self._write(write)
        self._adopt(paths, keys, rejected)

    def link(self, link: Link, paths: list[str], keys: list[str]) -> None:
        """A whole block taken from the previous version: its chunk files, then its record."""
        start, block, arrays = self.rows, self.blocks, self._ensure_arrays()
        assert start == block * self.s.block_rows, "a linked block starts at a block boundary"
        record = {"start": start, "paths": paths, "keys": keys, "digest": link.digest, "rejected": []}

        def write() -> None:
            store.link_block(link.arrays, link.block, arrays, block)
            store.write_record(self.s.work, self.job.key, block, record)

        self._write(write)
        self._adopt(paths, keys, [])
        self.out.reused += len(paths)

    def finish(self, trailing: list[Rejected]) -> BucketResult:
        """After writing(): every block is on disk."""
        self.out.rejected += trailing
        if not self.out.index:
            store.drop_bucket(self.s.work, self.job.key)
        else:
            store.trim(self._ensure_arrays(), len(self.out.index))
        return self.out


class _Assembly:
    """The block being filled: copied rows as they come, new rows encoded a batch at a time (the next batch
    starts before the last one's arrays are taken)."""

    def __init__(self, w: BucketWriter, encoder: Encode, on_commit: Callable[[int], None]):
        self.w, self.encoder, self.on_commit = w, encoder, on_commit
        self.inflight: list[tuple[list[int], Callable[[], dict[str, np.ndarray]]]] = []
        self._reset()

    def finish(self) -> BucketResult:
        """The bucket's result after its last block: images rejected past it count as done."""
        self.on_commit(len(self.rejected))
        return self.w.finish(self.rejected)

    def _reset(self) -> None:
        self.paths: list[str] = []
        self.keys: list[str] = []
        self.rows: list[dict | None] = []
        self.todo: list[tuple[int, torch.Tensor]] = []
        self.rejected: list[Rejected] = []

    def add(self, path: str, key: str, src: dict | torch.Tensor) -> None:
        self.paths.append(path)
        self.keys.append(key)
        if isinstance(src, dict):
            self.rows.append(src)
            self.w.out.reused += 1
        else:
            self.rows.append(None)
            self.todo.append((len(self.rows) - 1, src))
            if len(self.todo) == self.w.s.batch_size:
                self._encode()
        if len(self.paths) == self.w.s.block_rows:
            self.commit()

    def _encode(self) -> None:
        idx = [i for i, _ in self.todo]
        result = self.encoder.submit([p for _, p in self.todo], [self.paths[i] for i in idx], self.w.job.shape)
        self.inflight.append((idx, result))
        self.todo = []
        while len(self.inflight) > 1:
            self._land()

    def _land(self) -> None:
        idx, result = self.inflight.pop(0)
        out = result()
        for k, i in enumerate(idx):
            self.rows[i] = {name: arr[k] for name, arr in out.items()}
        self.w.out.encoded += len(idx)

    def commit(self) -> None:
        if self.todo:
            self._encode()
        while self.inflight:
            self._land()
        data = {name: np.stack([r[name] for r in self.rows]) for name in self.w.s.names}
        self.w.commit(data, self.paths, self.keys, self.rejected)
        self.on_commit(len(self.paths) + len(self.rejected))
        self._reset()


class _Decodes:
    """Decode jobs for the records that need encoding, submitted up to two blocks ahead of the writer."""

    def __init__(self, s: Settings, job: BucketJob, reuse: Reuse, pool: ThreadPoolExecutor, limit: int | None):
        self.s, self.job, self.reuse, self.pool = s, job, reuse, pool
        self.limit = len(job.records) if limit is None else min(limit, len(job.records))  # a shard's records end
        self.next = 0
        self.jobs: dict[int, Future] = {}

    def ahead_of(self, i: int) -> None:
        end = min(self.limit, i + 2 * self.s.block_rows)
        self.next = max(self.next, i)
        for k in range(self.next, end):
            if self.job.row_keys[k] not in self.reuse:
                rec = self.job.records[k]
                self.jobs[k] = self.pool.submit(prepare, self.s.roots[rec.source], rec)
        self.next = max(self.next, end)

    def take(self, i: int) -> torch.Tensor | str:
        """Record i's pixels or rejection reason (submitted by ahead_of, or decoded now past a shard's records,
        where rejected images moved its last block's end)."""
        job = self.jobs.pop(i, None)
        if job is None:
            rec = self.job.records[i]
            return prepare(self.s.roots[rec.source], rec)
        return job.result()


def fill_blocks(
    w: BucketWriter,
    start: int,
    encoder: Encode,
    reuse: Reuse,
    pool: ThreadPoolExecutor,
    advance: Callable[[int], None],
    stop: int | None = None,
) -> _Assembly:
    """Write blocks from record `start` on (the ones before were resumed) until the writer reaches block `stop` (a
    shard's part) or the bucket ends; returns the assembly, holding the images rejected after the last block (its
    `finish()` is the bucket's result). A block that is a whole block of the previous version, row for row, takes
    its chunk files; other rows are copied one by one or encoded. Blocks are filled exactly as a
    single process fills them, so a shard's blocks are byte for byte a single process's."""
    with w.writing():  # every block's write done (or failed) on the way out
        job, size = w.job, w.s.block_rows
        asm = _Assembly(w, encoder, advance)
        decodes = _Decodes(w.s, job, reuse, pool, None if stop is None else stop * size)
        i = start
        while i < len(job.records) and (stop is None or w.blocks < stop):
            decodes.ahead_of(i)  # new images decode while earlier blocks are linked or copied
            if not (asm.paths or asm.rejected):  # a block boundary (pending rejects go in the next written record)
                keys = job.row_keys[i : i + size]
                link = reuse.link(keys, size)
                if link is not None:
                    w.link(link, [r.ref for r in job.records[i : i + size]], keys)
                    advance(len(keys))
                    i += len(keys)
                    continue
            rec, key = job.records[i], job.row_keys[i]
            src = reuse.rows(key) if key in reuse else decodes.take(i)
            if isinstance(src, str):
                asm.rejected.append(Rejected(path=rec.ref, reason=src, kind="decode"))
            else:
                asm.add(rec.ref, key, src)
            i += 1
        if asm.paths:
            asm.commit()
        return asm
