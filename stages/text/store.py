"""Layout of the text cache and its read side.

    text.zarr/<field>   (N, ...) one row per distinct string encoded; every tensor the family returns, floats in
                        text.dtype, integer/bool tensors (attention masks) in their own dtype
    strings.jsonl       {"row", "text"}: the exact string of each row; row 0 is always "" (caption dropout)
    captions.jsonl      {"caption", "rows"}: each dataset caption (and "") -> the row of each of its K variants
    controls.jsonl      only where rows are per (instruction, control image): {"sha256", "path"} of each control;
                        strings and captions are then pair_key(string, control sha256) (stages/text/controls.py)

A text artifact built with text.enabled false holds only its manifest: consumers encode live (stages/text/live.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import zarr

from tuneline.stages.common.jsonl import read_jsonl

STORE = "text.zarr"
INDEX = "captions.jsonl"
STRINGS = "strings.jsonl"
# With rows per (instruction, control image) (stages/text/controls.py): the control images they were encoded with.
CONTROLS = "controls.jsonl"
SEP = "\x1f"  # between a pair key's control sha256 and its string (ASCII unit separator: not in a hex hash)
# Rows are buffered into chunks of about this size: whole-chunk writes, and a lazy reader fetches little extra.
CHUNK_BYTES = 4 << 20
# Caches up to this size are read into memory; bigger ones (long T5 embeddings of large datasets) stay on disk.
MEMORY_LIMIT = 2 << 30


class ArrayWriter:
    """Writes batches of encoder output into one Zarr array per field, buffered so every chunk is written once,
    whole (a partial chunk write is a read-modify-write of the entire chunk)."""

    def __init__(self, path: Path, rows: int):
        self.group = zarr.open_group(str(path), mode="w")
        self.rows, self.written, self.chunk = rows, 0, 0
        self.buffer: dict[str, list[torch.Tensor]] = {}
        self.fields: dict[str, dict] = {}

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        if not self.fields:
            self._create(batch)
        got = {k: {"shape": tuple(t.shape[1:]), "dtype": _dtype(t)} for k, t in batch.items()}
        if got != self.fields:
            raise RuntimeError(
                f"text encoder output changed mid-run at row {self.written + self._buffered()}: {got} vs {self.fields}"
            )
        for name, t in batch.items():
            self.buffer[name].append(t)
        while self._buffered() >= self.chunk:
            self._flush(self.chunk)

    def close(self) -> dict[str, dict]:
        self._flush(self._buffered())
        if self.written != self.rows:
            raise RuntimeError(f"text cache holds {self.written} rows, expected {self.rows}")
        return self.fields

    def _create(self, batch: dict[str, torch.Tensor]) -> None:
        row_bytes = max(t[0].numel() * t.element_size() for t in batch.values())
        self.chunk = max(1, min(self.rows, CHUNK_BYTES // max(1, row_bytes)))
        for name, t in batch.items():
            self.group.create_array(
                name, shape=(self.rows, *t.shape[1:]), chunks=(self.chunk, *t.shape[1:]), dtype=_dtype(t)
            )
            self.fields[name] = {"shape": tuple(t.shape[1:]), "dtype": _dtype(t)}
            self.buffer[name] = []

    def _buffered(self) -> int:
        return sum(len(t) for t in next(iter(self.buffer.values()), []))

    def _flush(self, n: int) -> None:
        if n == 0:
            return
        for name, parts in self.buffer.items():
            data = torch.cat(parts)
            self.group[name][self.written : self.written + n] = data[:n].numpy()
            self.buffer[name] = [data[n:]] if len(data) > n else []
        self.written += n


class TextCache:
    """Read side: captions (+ variant per sample) -> the cached tensors, batch first, on the CPU."""

    def __init__(self, artifact_dir: Path, fields: Iterable[str], memory_limit: int = MEMORY_LIMIT):
        self.dir = Path(artifact_dir)
        if not (self.dir / STORE).is_dir():
            raise ValueError(
                f"text artifact {self.dir} holds no cache (built with text.enabled false): encode "
                f"live with tuneline.stages.text.live.open_text, or set text.enabled true and run "
                f"`tuneline stage text`"
            )
        group = zarr.open_group(str(self.dir / STORE), mode="r")
        self.index: dict[str, list[int]] = {r["caption"]: r["rows"] for r in read_jsonl(self.dir / INDEX)}
        # Rows per (instruction, control image): looked up by stages.text.controls.pair_key.
        self.paired = (self.dir / CONTROLS).is_file()
        self.variants = len(self.index[""])
        arrays = {}
        for f in fields:
            if f not in group:
                raise ValueError(f"text artifact {self.dir} has no field {f!r}; run `tuneline stage text --force`")
            arrays[f] = group[f]
        in_memory = sum(a.nbytes for a in arrays.values()) <= memory_limit
        self.arrays = {f: torch.from_numpy(np.asarray(a[:])) if in_memory else a for f, a in arrays.items()}
        rows = 1 + max(r for rs in self.index.values() for r in rs)
        short = [f for f, a in arrays.items() if a.shape[0] < rows]
        if short:
            raise ValueError(
                f"text artifact {self.dir}: field(s) {short} hold fewer rows than its index names "
                f"({rows}); the cache is damaged, run `tuneline stage text --force`"
            )

    def rows(self, captions: list[str], variant_ids: list[int] | None = None) -> list[int]:
        ids = [0] * len(captions) if variant_ids is None else list(variant_ids)
        if len(ids) != len(captions):
            raise ValueError(f"{len(ids)} variant ids for {len(captions)} captions")
        bad = [v for v in ids if not 0 <= v < self.variants]
        if bad:
            raise IndexError(
                f"caption variant {bad[0]} out of range: the text cache holds {self.variants} per "
                f"caption (text.caption_variants)"
            )
        missing = [c for c in captions if c not in self.index]
        if missing:
            raise KeyError(
                f"caption not in the text cache {self.dir}: {missing[0]!r}; rebuild it with `tuneline stage text`"
            )
        return [self.index[c][v] for c, v in zip(captions, ids)]

    def get(self, captions: list[str], variant_ids: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Every cached tensor for these captions; variant_ids picks each sample's variant (default 0, the caption
        as written). The empty caption is row 0 for every variant."""
        rows = self.rows(captions, variant_ids)
        return {f: take_rows(a, rows) for f, a in self.arrays.items()}


def pair_key(text: str, control_sha256: str | None) -> str:
    """The row key of `text` encoded with the control image of this content hash (a record without a control:
    `text` itself, a text-only row)."""
    return f"{control_sha256}{SEP}{text}" if control_sha256 else text


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def take_rows(array, rows: list[int]) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array[torch.tensor(rows, dtype=torch.long)]
    # On-disk arrays: read each distinct row once, in order (what Zarr's orthogonal selection expects).
    uniq, inverse = np.unique(np.asarray(rows), return_inverse=True)
    return torch.from_numpy(np.asarray(array.oindex[uniq]))[torch.from_numpy(inverse)]
