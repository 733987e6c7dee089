"""Zarr layout of the latent cache. The writer, the training reader and validation all go through here.

    latents.zarr/<W>x<H>/mean        (N, C, h, w)  latent distribution mean, one row per image
    latents.zarr/<W>x<H>/std         (N, C, h, w)  its std; training samples mean + std * eps every step
    latents.zarr/<W>x<H>/flip_mean   (N, C, h, w)  the same for the horizontally flipped image (latents.flip)
    latents.zarr/<W>x<H>/flip_std
    index.jsonl                      one row per cached image: {"path", "bucket", "row", "key"}
    blocks/<W>x<H>/<i>.json          one record per finished block: its rows, the images rejected while
                                     filling it, and a digest of its data
    rejected.jsonl                   images that passed the scan but could not be decoded at caching time

Rows of a bucket are its images sorted by path (rejected ones skipped), so the layout is a pure function of
the scan records and a resumed build agrees with the interrupted one. `key` identifies a row's content (image
bytes, bucket, crop, VAE, dtypes): a later build copies rows whose key it needs instead of encoding them.

Chunking follows the access pattern. One chunk = one block of `block_rows` rows of one array, uncompressed:
- the writer fills a whole block before writing it, so every chunk file has one writer and is written once,
  whole, under a temporary name and renamed into place (write_block): a chunk file is never changed in place,
  which the hard links between versions (link_block) rely on; no sharding, since a shard of several blocks would
  be rewritten for every block;
- the block record is written after the block's chunks: a build killed at any point loses at most the block
  in flight, and a resumed build re-checks each record's digest before trusting it;
- the training reader reads whole blocks (single-row Zarr reads are 10-20x slower, docs/platform.md) and keeps a
  few per bucket in memory; float16 latents barely compress, so compression would only cost read time.
  Uncompressed, a chunk file is the block's raw little-endian bytes (Zarr v3 `bytes` codec), so the reader
  maps it as one file (`read_chunk`), 4-5x faster than zarr's asynchronous read path. The store
  stays a standard Zarr v3 store that any Zarr client reads (`zarr.open_group`).
Zarr's public API creates and resizes the arrays (their `zarr.json`); chunk files are read and written here through
the Zarr v3 specification alone (RawArray: an array's metadata document, its chunk key encoding and `bytes` codec),
so no zarr internals are used and a zarr release that changes its writer changes nothing here.
The reading functions also take an fsspec URL (`s3://bucket/prefix/latents/<version>`) and its storage options,
so training can read a pushed version in place (stages/common/remote.py): on object storage a chunk is one GET.
The default block of 64 rows is 2 MB per array at SD1.5's 4x64x64 latents and 8 MB at SDXL's 4x128x128: one
sequential read each, and a reader holding 2 x 4 blocks per bucket (reader.py) needs tens of MB per bucket.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import numpy as np
import zarr

from tuneline.stages.common.jsonl import read_jsonl

RAW_CODECS = ({"name": "bytes", "configuration": {"endian": "little"}},)
STORE = "latents.zarr"
INDEX = "index.jsonl"
BLOCKS = "blocks"
DIST = ("mean", "std")
FLIPPED = ("flip_mean", "flip_std")


def bucket_key(width: int, height: int, frames: int | None = None) -> str:
    """A bucket's array group: "<W>x<H>", and "<W>x<H>x<F>f" for a video family's clips of F > 1 frames."""
    return f"{width}x{height}" if (frames or 1) == 1 else f"{width}x{height}x{frames}f"


# numpy parses .npy headers with ast.literal_eval, whose depth state CPython keeps interpreter-wide: two feed threads
# opening at once raised `SystemError: AST constructor recursion depth mismatch` (3.11.7). Each opens once (cached).
_NPY_OPEN = threading.Lock()


def open_npy(path: Path) -> np.ndarray:
    """A read-only memory map of the .npy file at `path` (the edit controls' and masks' caches)."""
    with _NPY_OPEN:
        return np.load(path, mmap_mode="r")


def array_names(flip: bool) -> tuple[str, ...]:
    return DIST + FLIPPED if flip else DIST


# Arrays as the Zarr v3 specification describes them ------------------------------------------------------
@dataclass(frozen=True)
class RawArray:
    """One array of the store, from its `zarr.json` metadata document (Zarr v3 specification): where its chunk
    files are and how they are named and encoded. `where` is the array's folder, or its URL on remote storage."""

    where: Path | str
    meta: dict
    options: dict | None = field(default=None, compare=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta["shape"])

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(self.meta["chunk_grid"]["configuration"]["chunk_shape"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["data_type"])

    @property
    def ndim(self) -> int:
        return len(self.meta["shape"])

    @property
    def local(self) -> bool:
        return not is_url(self.where)

    def chunk_key(self, block: int) -> str:
        """The chunk key of the chunk holding rows of `block` (spec: chunk key encodings `default` and `v2`)."""
        enc = self.meta["chunk_key_encoding"]
        default = "/" if enc["name"] == "default" else "."
        sep = enc.get("configuration", {}).get("separator", default)
        coords = [str(block)] + ["0"] * (self.ndim - 1)
        return sep.join(["c", *coords]) if enc["name"] == "default" else sep.join(coords)

    def chunk_path(self, block: int) -> Path | str:
        return join(self.where, *self.chunk_key(block).split("/"))


def _open_raw(where: Path | str, options: dict | None = None) -> RawArray:
    if is_url(where):
        fs, path = fsspec.core.url_to_fs(str(where), **(options or {}))
        text = fs.cat_file(f"{path}/zarr.json")
    else:
        text = (Path(where) / "zarr.json").read_bytes()
    return RawArray(where, json.loads(text), options)


def create_arrays(
    root: Path,
    bucket: str,
    shape: tuple[int, int, int],
    capacity: int,
    dtype: str,
    block_rows: int,
    names: tuple[str, ...],
) -> dict[str, RawArray]:
    """The bucket's arrays, reopened when a resumed build already made them with this layout.

    `capacity` is the bucket's image count; rows of images rejected while encoding are trimmed at the end.
    An array trimmed by an interrupted build is grown back: its finished blocks are still valid.
    """
    group = zarr.open_group(str(root / STORE), mode="a").require_group(bucket)
    chunks = (block_rows, *shape)
    for name in names:
        if name in group.array_keys():
            arr = group[name]
            if (arr.shape[1:], arr.chunks, arr.dtype) == (shape, chunks, np.dtype(dtype)):
                if arr.shape[0] != capacity:
                    arr.resize((capacity, *shape))
                continue
        group.create_array(
            name,
            shape=(capacity, *shape),
            chunks=chunks,
            dtype=dtype,
            compressors=None,
            fill_value=0,
            overwrite=True,
            config={"write_empty_chunks": True},
        )
    return {name: _open_raw(root / STORE / bucket / name) for name in names}


def write_block(arrays: dict[str, RawArray], block: int, data: dict[str, np.ndarray]) -> None:
    """One whole block per array, each a chunk file written under a temporary name and renamed into place: the
    file a previous version may share by a hard link (link_block) is replaced, never written into. A short last
    block is padded with the fill value, as every chunk of a Zarr array holds a whole chunk."""
    for name, arr in arrays.items():
        problem = raw_layout_problem(arr)
        if problem or not arr.local:
            raise ValueError(f"cannot write {arr.where} chunk by chunk: {problem or 'it is not local'}")
        rows = np.ascontiguousarray(data[name], dtype=arr.dtype.newbyteorder("<"))
        if rows.shape[1:] != arr.chunks[1:] or len(rows) > arr.chunks[0]:
            raise ValueError(f"block of shape {rows.shape} does not fit chunks of {arr.chunks} in {arr.where}")
        chunk = np.full(arr.chunks, arr.meta.get("fill_value") or 0, dtype=rows.dtype)
        chunk[: len(rows)] = rows
        target = Path(arr.chunk_path(block))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + PARTIAL)
        tmp.write_bytes(chunk.tobytes())
        os.replace(tmp, target)


PARTIAL = ".partial"  # a chunk file being written (write_block); a leftover is removed by trim


def read_arrays(arrays: dict[str, RawArray], start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows start:stop of every array, read chunk by chunk."""
    out = {}
    for name, arr in arrays.items():
        size = arr.chunks[0]
        parts = [read_rows(arr, b) for b in range(start // size, -(-stop // size))]
        rows = np.concatenate(parts) if parts else np.empty((0, *arr.chunks[1:]), arr.dtype)
        first = (start // size) * size
        out[name] = rows[start - first : stop - first]
    return out


def read_blocks(arrays: dict[str, RawArray], block: int) -> dict[str, np.ndarray]:
    """Every array's rows of one block."""
    return {name: read_rows(arr, block) for name, arr in arrays.items()}


def read_rows(arr: RawArray, block: int) -> np.ndarray:
    """The rows of one block: mapped straight from the chunk file where read_chunk can, else through zarr."""
    if raw_layout_problem(arr) is None:
        return read_chunk(arr, block)
    zarr_array = zarr.open_array(str(arr.where), mode="r", storage_options=arr.options)
    return zarr_array[block * arr.chunks[0] : (block + 1) * arr.chunks[0]]


def block_digest(data: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(data):
        h.update(name.encode())
        h.update(np.ascontiguousarray(data[name]).tobytes())
    return h.hexdigest()


def trim(arrays: dict[str, RawArray], count: int) -> None:
    """Every array cut (or grown) to `count` rows, through zarr's public API; `arrays` then describes them anew."""
    for name, arr in arrays.items():
        for leftover in Path(arr.where).rglob(f"*{PARTIAL}"):
            leftover.unlink()  # a chunk write killed before its rename
        if arr.shape[0] != count:
            zarr.open_array(str(arr.where), mode="r+").resize((count, *arr.shape[1:]))
            arrays[name] = _open_raw(arr.where)


def drop_bucket(root: Path, bucket: str) -> None:
    """Remove a bucket none of whose images could be encoded (its arrays may exist from a resumed build).

    Zarr v3 group metadata lists no children (we never consolidate), so removing the folders is enough.
    """
    for path in (root / STORE / bucket, root / BLOCKS / bucket):
        if path.exists():
            shutil.rmtree(path)


# Block records ---------------------------------------------------------------------------------------
def _record_path(root: Path, bucket: str, block: int) -> Path:
    return root / BLOCKS / bucket / f"{block:06d}.json"


def write_record(root: Path, bucket: str, block: int, record: dict) -> None:
    path = _record_path(root, bucket, block)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)  # a record is either absent or complete


def read_records(root: Path, bucket: str) -> list[dict]:
    """Finished blocks in order, stopping at the first gap or unreadable record."""
    out = []
    while (record := read_record(root, bucket, len(out))) is not None:
        out.append(record)
    return out


def read_record(root: Path, bucket: str, block: int) -> dict | None:
    try:
        return json.loads(_record_path(root, bucket, block).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def drop_records(root: Path, bucket: str, first: int) -> None:
    """Forget blocks from `first` on (they will be written again)."""
    folder = root / BLOCKS / bucket
    for path in folder.glob("*.json") if folder.is_dir() else ():
        if int(path.stem) >= first:
            path.unlink()


# Reading ---------------------------------------------------------------------------------------------
def is_url(root: Path | str) -> bool:
    return "://" in str(root)


def join(root: Path | str, *parts: str) -> Path | str:
    """root/parts; a URL stays a string joined with "/" (Path("s3://b/p") would collapse to "s3:/b/p")."""
    if is_url(root):
        return "/".join([str(root).rstrip("/"), *parts])
    return Path(root).joinpath(*parts)


def open_arrays(
    root: Path | str, bucket: str, names: tuple[str, ...], storage_options: dict | None = None
) -> dict[str, RawArray]:
    return {name: _open_raw(join(root, STORE, bucket, name), storage_options) for name in names}


def open_bucket(
    root: Path | str, width: int, height: int, storage_options: dict | None = None, *, frames: int | None = None
) -> zarr.Group:
    key = bucket_key(width, height, frames)
    return zarr.open_group(str(join(root, STORE, key)), mode="r", storage_options=storage_options)


def read_index(root: Path | str, storage_options: dict | None = None) -> Iterator[dict]:
    """The rows of index.jsonl, local or remote (streamed, so a large index is never held as text)."""
    return read_jsonl(join(root, INDEX), storage_options)


def read_block(group: zarr.Group, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) of rows start:stop: whole-block reads for consumers that want plain arrays."""
    return group["mean"][start:stop], group["std"][start:stop]


def raw_layout_problem(arr: RawArray) -> str | None:
    """Why read_chunk cannot read this array (None: it can). Our writer always makes arrays it can."""
    m = arr.meta
    if m.get("zarr_format") != 3 or m.get("node_type") != "array":
        return f"it is not a Zarr v3 array (zarr_format {m.get('zarr_format')}, node_type {m.get('node_type')})"
    if m.get("chunk_grid", {}).get("name") != "regular" or m.get("storage_transformers"):
        return "its chunk grid is not regular, or it has storage transformers"
    if m.get("chunk_key_encoding", {}).get("name") not in ("default", "v2"):
        return f"its chunk key encoding {m.get('chunk_key_encoding')} is not one of the specification's"
    codecs = tuple(m.get("codecs", ()))
    if codecs != RAW_CODECS:
        return f"its codecs are {list(codecs)}, not uncompressed little-endian bytes"
    try:
        np.dtype(m["data_type"])
    except (KeyError, TypeError):
        return f"its data type {m.get('data_type')!r} is not a plain number type"
    return None


def can_link(arr: RawArray) -> bool:
    """Whether link_block can share this array's chunk files: raw chunks in a local folder."""
    return arr.local and raw_layout_problem(arr) is None


def link_block(src: dict[str, RawArray], src_block: int, dst: dict[str, RawArray], dst_block: int) -> None:
    """dst's block `dst_block` becomes src's block `src_block`: the same chunk files (both raw, same chunk shape
    and dtype), hard-linked where the filesystem allows, else copied. Sharing is safe because a chunk file is
    never changed in place: write_block writes a new file and renames it over the old name, and an existing
    target is unlinked here first, never written into. No temporary name is needed: until the block's record is
    written after this, a resumed build redoes the block."""
    for name, arr in dst.items():
        source, target = Path(src[name].chunk_path(src_block)), Path(arr.chunk_path(dst_block))
        if src[name].chunks != arr.chunks or src[name].dtype != arr.dtype:
            raise ValueError(
                f"cannot link {source} into {target}: chunks {src[name].chunks} {src[name].dtype} "
                f"vs {arr.chunks} {arr.dtype}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # an interrupted attempt's chunk, possibly itself a link: never write into it
        try:
            os.link(source, target)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(source, target)


def read_chunk(arr: RawArray, block: int) -> np.ndarray:
    """The rows of one chunk, read straight from its file or object (see raw_layout_problem for when that is valid)."""
    dtype = arr.dtype.newbyteorder("<")
    where = arr.chunk_path(block)
    flat = _mapped(Path(where), dtype) if arr.local else _fetch_chunk(str(where), arr.options, dtype)
    if flat.size != math.prod(arr.chunks):
        raise ValueError(
            f"chunk file {where} holds {flat.size} values, a chunk has {math.prod(arr.chunks)} (truncated or edited)"
        )
    rows = min(arr.chunks[0], arr.shape[0] - block * arr.chunks[0])
    return flat.reshape(arr.chunks)[:rows]


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray:
    """The file's values, memory-mapped and read-only. Mapped, not read: the reader copies the rows it needs straight
    from the page cache, where a read into fresh memory costs a page fault per 4 KiB and halves the training feed's
    rate (bench/loader.py). Through torch.from_file, not np.memmap: np.memmap holds a file descriptor per map, and a
    training reader keeps thousands of maps (reader.MAPPED_BLOCKS) where 1,024 descriptors is a common limit."""
    import torch  # only processes that read chunks (training, the latents stage) map them; `tuneline status` never

    count = path.stat().st_size // dtype.itemsize
    if not count:
        return np.empty(0, dtype)
    kind = torch.from_numpy(np.empty(0, dtype)).dtype
    values = torch.from_file(str(path), shared=False, size=count, dtype=kind).numpy()
    values.flags.writeable = False  # private pages: a stray write would change this process's view, never the file
    return values


def _fetch_chunk(url: str, options: dict | None, dtype: np.dtype) -> np.ndarray:
    """One GET through fsspec's blocking API. A missing chunk raises rather than reading as the fill value, as a
    missing local chunk file does."""
    fs, path = fsspec.core.url_to_fs(url, **(options or {}))
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"chunk object {url} is missing") from None
    return np.frombuffer(data, dtype=dtype)
