"""Writing one bucket block by block: resume finished blocks, copy reusable rows, encode the rest.

A block is `block_rows` consecutive rows. It is assembled in memory (rows copied from the previous version
and rows encoded now), written as one chunk per array, then recorded in `blocks/`. Decoding runs ahead in
the worker pool while the VAE encodes, so the VAE rarely waits for pixels.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from schemas.scan import ImageRecord, Rejected
from stages.latents import store
from stages.latents.encode import prepare


@dataclass
class BucketJob:
    key: str  # "<W>x<H>"
    width: int
    height: int
    shape: tuple[int, int, int]
    records: list[ImageRecord]  # sorted by path: row order
    row_keys: list[str]  # content identity of each record's row


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


class BucketWriter:
    def __init__(self, s: Settings, job: BucketJob):
        self.s, self.job = s, job
        self.arrays: dict | None = None  # created with the first block: a bucket may end up empty
        self.blocks = 0
        self.out = BucketResult()

    def _ensure_arrays(self) -> dict:
        if self.arrays is None:
            j, s = self.job, self.s
            self.arrays = store.create_arrays(s.work, j.key, j.shape, len(j.records), s.dtype, s.block_rows,
                                              s.names)
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
        span = dict(zip((r.ref for r in j.records[consumed:consumed + n]), j.row_keys[consumed:consumed + n]))
        if (rec["start"] != len(self.out.index)
                or set(span) != set(rec["paths"]) | {r["path"] for r in rec["rejected"]}
                or [span.get(p) for p in rec["paths"]] != rec["keys"]):
            return False
        start = len(self.out.index)
        data = store.read_arrays(self._ensure_arrays(), start, start + len(rec["paths"]))
        return store.block_digest(data) == rec["digest"]

    def _adopt(self, paths: list[str], keys: list[str], rejected: list[Rejected]) -> None:
        start = len(self.out.index)
        self.out.index += [{"path": p, "bucket": self.job.key, "row": start + i, "key": k}
                           for i, (p, k) in enumerate(zip(paths, keys))]
        self.out.rejected += rejected
        self.blocks += 1

    def commit(self, data: dict[str, np.ndarray], paths: list[str], keys: list[str],
               rejected: list[Rejected]) -> None:
        """Write a full block, then its record: until the record exists the block does not count."""
        start = len(self.out.index)
        assert start == self.blocks * self.s.block_rows, "only a bucket's last block may be short"
        store.write_block(self._ensure_arrays(), self.blocks, data)
        record = {"start": start, "paths": paths, "keys": keys, "digest": store.block_digest(data),
                  "rejected": [r.model_dump(mode="json") for r in rejected]}
        store.write_record(self.s.work, self.job.key, self.blocks, record)
        self._adopt(paths, keys, rejected)

    def finish(self, trailing: list[Rejected]) -> BucketResult:
        self.out.rejected += trailing
        if not self.out.index:
            store.drop_bucket(self.s.work, self.job.key)
        else:
            store.trim(self._ensure_arrays(), len(self.out.index))
        return self.out


class _Assembly:
    """The block being filled: copied rows as they come, new rows encoded a batch at a time."""

    def __init__(self, w: BucketWriter, encoder: Callable, on_commit: Callable[[int], None]):
        self.w, self.encoder, self.on_commit = w, encoder, on_commit
        self._reset()

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
        out = self.encoder([p for _, p in self.todo], [self.paths[i] for i in idx], self.w.job.shape)
        for k, i in enumerate(idx):
            self.rows[i] = {name: arr[k] for name, arr in out.items()}
        self.w.out.encoded += len(idx)
        self.todo = []

    def commit(self) -> None:
        if self.todo:
            self._encode()
        data = {name: np.stack([r[name] for r in self.rows]) for name in self.w.s.names}
        self.w.commit(data, self.paths, self.keys, self.rejected)
        self.on_commit(len(self.paths) + len(self.rejected))
        self._reset()


def _sources(s: Settings, job: BucketJob, start: int, copy: Callable[[str], dict | None],
             pool: ThreadPoolExecutor) -> Iterator[tuple[ImageRecord, str, dict | Future]]:
    """Each remaining record with its copied arrays or its decode job; decoding runs two blocks ahead."""
    pending: deque = deque()
    for rec, key in zip(job.records[start:], job.row_keys[start:]):
        copied = copy(key)
        pending.append((rec, key, copied if copied is not None else pool.submit(prepare, s.roots[rec.source], rec)))
        if len(pending) > 2 * s.block_rows:
            yield pending.popleft()
    yield from pending


def fill(w: BucketWriter, start: int, encoder: Callable, copy: Callable[[str], dict | None],
         pool: ThreadPoolExecutor, advance: Callable[[int], None]) -> BucketResult:
    """Write every block of the bucket from record `start` on (the ones before were resumed)."""
    asm = _Assembly(w, encoder, advance)
    for rec, key, src in _sources(w.s, w.job, start, copy, pool):
        if isinstance(src, Future):
            src = src.result()
        if isinstance(src, str):
            asm.rejected.append(Rejected(path=rec.ref, reason=src, kind="decode"))
            continue
        asm.add(rec.ref, key, src)
    if asm.paths:
        asm.commit()
    advance(len(asm.rejected))
    return w.finish(asm.rejected)
