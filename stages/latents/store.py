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
- the writer fills a whole block before writing it, so every chunk file has one writer and is written once
  (Zarr replaces a chunk file atomically; concurrent writers into one chunk or shard lose rows, docs/platform.md);
  no sharding, since a shard of several blocks would be rewritten for every block;
- the block record is written after the block's chunks: a build killed at any point loses at most the block
  in flight, and a resumed build re-checks each record's digest before trusting it;
- the training reader reads whole blocks (single-row Zarr reads are 10-20x slower, docs/platform.md) and keeps a
  few per bucket in memory; float16 latents barely compress, so compression would only cost read time.
  Uncompressed, a chunk file is the block's raw little-endian bytes (Zarr v3 `bytes` codec), so the reader
  maps it as one file (`read_chunk`), 4-5x faster than zarr's asynchronous read path. The store
  stays a standard Zarr v3 store that any Zarr client reads.
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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import zarr

from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore

from tuneline.stages.common.jsonl import read_jsonl

RAW_CODECS = ({"name": "bytes", "configuration": {"endian": "little"}},)
STORE = "latents.zarr"
INDEX = "index.jsonl"
BLOCKS = "blocks"
DIST = ("mean", "std")
FLIPPED = ("flip_mean", "flip_std")


def bucket_key(width: int, height: int) -> str:
    return f"{width}x{height}"


def array_names(flip: bool) -> tuple[str, ...]:
    return DIST + FLIPPED if flip else DIST


def create_arrays(root: Path, bucket: str, shape: tuple[int, int, int], capacity: int, dtype: str,
                  block_rows: int, names: tuple[str, ...]) -> dict[str, zarr.Array]:
    """The bucket's arrays, reopened when a resumed build already made them with this layout.

    `capacity` is the bucket's image count; rows of images rejected while encoding are trimmed at the end.
    An array trimmed by an interrupted build is grown back: its finished blocks are still valid.
    """
    group = zarr.open_group(str(root / STORE), mode="a").require_group(bucket)
    chunks = (block_rows, *shape)
    out = {}
    for name in names:
        if name in group.array_keys():
            arr = group[name]
            if (arr.shape[1:], arr.chunks, arr.dtype) == (shape, chunks, np.dtype(dtype)):
                if arr.shape[0] != capacity:
                    arr.resize((capacity, *shape))
                out[name] = arr
                continue
        out[name] = group.create_array(name, shape=(capacity, *shape), chunks=chunks, dtype=dtype,
                                       compressors=None, fill_value=0, overwrite=True,
                                       config={"write_empty_chunks": True})
    return out


def write_block(arrays: dict[str, zarr.Array], block: int, data: dict[str, np.ndarray]) -> None:
    """One whole block per array: a single chunk write each."""
    for name, arr in arrays.items():
        start = block * arr.chunks[0]
        arr[start:start + len(data[name])] = data[name]


def read_arrays(arrays: dict[str, zarr.Array], start: int, stop: int) -> dict[str, np.ndarray]:
    return {name: arr[start:stop] for name, arr in arrays.items()}


def read_blocks(arrays: dict[str, zarr.Array], block: int) -> dict[str, np.ndarray]:
    """Every array's rows of one block: mapped straight from the chunk files where read_chunk can, else via Zarr."""
    return {name: read_chunk(arr, block) if raw_layout_problem(arr) is None
            else arr[block * arr.chunks[0]:(block + 1) * arr.chunks[0]] for name, arr in arrays.items()}


def block_digest(data: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(data):
        h.update(name.encode())
        h.update(np.ascontiguousarray(data[name]).tobytes())
    return h.hexdigest()


def trim(arrays: dict[str, zarr.Array], count: int) -> None:
    for arr in arrays.values():
        if arr.shape[0] != count:
            arr.resize((count, *arr.shape[1:]))


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


def open_arrays(root: Path | str, bucket: str, names: tuple[str, ...],
                storage_options: dict | None = None) -> dict[str, zarr.Array]:
    group = zarr.open_group(str(join(root, STORE, bucket)), mode="r", storage_options=storage_options)
    return {name: group[name] for name in names}


def open_bucket(root: Path | str, width: int, height: int, storage_options: dict | None = None) -> zarr.Group:
    return zarr.open_group(str(join(root, STORE, bucket_key(width, height))), mode="r",
                           storage_options=storage_options)


def read_index(root: Path | str, storage_options: dict | None = None) -> Iterator[dict]:
    """The rows of index.jsonl, local or remote (streamed, so a large index is never held as text)."""
    return read_jsonl(join(root, INDEX), storage_options)


def read_block(group: zarr.Group, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) of rows start:stop: whole-block reads for consumers that want plain arrays."""
    return group["mean"][start:stop], group["std"][start:stop]


def raw_layout_problem(arr: zarr.Array) -> str | None:
    """Why read_chunk cannot read this array (None: it can). Our writer always makes arrays it can."""
    codecs = tuple(arr.metadata.to_dict().get("codecs", ()))
    if not isinstance(arr.store, (LocalStore, FsspecStore)):
        return f"it is neither on a local filesystem nor behind fsspec ({type(arr.store).__name__})"
    if codecs != RAW_CODECS:
        return f"its codecs are {list(codecs)}, not uncompressed little-endian bytes"
    return None


def _chunk_key(arr: zarr.Array, block: int) -> str:
    return arr.metadata.chunk_key_encoding.encode_chunk_key((block,) + (0,) * (arr.ndim - 1))


def _chunk_file(arr: zarr.Array, block: int) -> Path:
    return Path(arr.store.root) / arr.path / _chunk_key(arr, block)


def can_link(arr: zarr.Array) -> bool:
    """Whether link_block can share this array's chunk files: raw chunks in a local folder."""
    return isinstance(arr.store, LocalStore) and raw_layout_problem(arr) is None


def link_block(src: dict[str, zarr.Array], src_block: int, dst: dict[str, zarr.Array], dst_block: int) -> None:
    """dst's block `dst_block` becomes src's block `src_block`: the same chunk files (both raw, same chunk shape
    and dtype), hard-linked where the filesystem allows, else copied. Sharing is safe because a chunk file is
    never changed in place: Zarr (3.1.3 and later) replaces a chunk by writing a new file and renaming it over the
    old name, and an existing target is unlinked first, never written into. No temporary name is needed: until the
    block's record is written after this, a resumed build redoes the block."""
    for name, arr in dst.items():
        source, target = _chunk_file(src[name], src_block), _chunk_file(arr, dst_block)
        if src[name].chunks != arr.chunks or src[name].dtype != arr.dtype:
            raise ValueError(f"cannot link {source} into {target}: chunks {src[name].chunks} {src[name].dtype} "
                             f"vs {arr.chunks} {arr.dtype}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)  # an interrupted attempt's chunk, possibly itself a link: never write into it
        try:
            os.link(source, target)
        except OSError:  # another filesystem, or one without hard links
            shutil.copyfile(source, target)


def read_chunk(arr: zarr.Array, block: int) -> np.ndarray:
    """The rows of one chunk, read straight from its file or object (see raw_layout_problem for when that is valid)."""
    key = _chunk_key(arr, block)
    dtype = arr.dtype.newbyteorder("<")
    if isinstance(arr.store, LocalStore):
        where = _chunk_file(arr, block)
        flat = _mapped(where, dtype)
    else:
        flat, where = _fetch_chunk(arr.store, f"{arr.path}/{key}", dtype)
    if flat.size != math.prod(arr.chunks):
        raise ValueError(f"chunk file {where} holds {flat.size} values, a chunk has {math.prod(arr.chunks)} "
                         f"(truncated or edited)")
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


def _fetch_chunk(fsstore: FsspecStore, key: str, dtype: np.dtype) -> tuple[np.ndarray, str]:
    """One GET through the store's own (asynchronous) filesystem, run on zarr's event loop.

    The store's fs was made with asynchronous=True, so its blocking methods cannot be called; zarr's loop is
    the one that fs is bound to. A missing chunk raises rather than reading as the fill value, as a missing
    local chunk file does.
    """
    where = fsstore.fs.unstrip_protocol(f"{fsstore.path}/{key}")
    buf = sync(fsstore.get(key, prototype=default_buffer_prototype()))
    if buf is None:
        raise FileNotFoundError(f"chunk object {where} is missing")
    return np.frombuffer(buf.to_bytes(), dtype=dtype), where
