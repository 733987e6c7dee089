"""Where a webdataset or parquet source lives: a local path or an fsspec URL (s3://, gs://, file://), the shard
files in it, and what identifies each one without reading it.

A shard's identity is its size plus what the store says about its content (S3's ETag, GCS's checksum) or, where
the store has none (a local disk), its mtime: a scheduled run over a prefix with one new shard reads that shard
only. A shard whose identity changed is read again and confirmed by its content hash (shardindex.py).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneline.schemas.base import is_url
from tuneline.schemas.scan import IMAGE_EXTENSIONS, Location
from tuneline.schemas.sources import Source
from tuneline.stages.common.remote import storage_options
from tuneline.stages.common.stage import StageFailed

if TYPE_CHECKING:
    import fsspec

EXTENSIONS = {".tar": "webdataset", ".parquet": "parquet"}
# What a store reports about an object's content, in order of preference (s3fs: ETag; gcsfs: md5Hash/crc32c).
CHECKSUM_KEYS = ("ETag", "etag", "md5Hash", "crc32c", "checksum", "content_md5")


@dataclass(frozen=True)
class ShardFile:
    rel: str  # relative to the source ('' when the source is this one file)
    path: str  # the filesystem's own path for it
    size: int
    identity: str

    @property
    def name(self) -> str:
        """How messages name it: its path in the source, or its file name when the source is this one file."""
        return self.rel or posixpath.basename(self.path)


class LocalFiles:
    """The calls the scan makes on a local disk (open, isfile, exists, info, find), answered by `os` with what
    fsspec's LocalFileSystem says of a file (its size and mtime: the shard's identity). Importing fsspec is a tenth
    of the CPU time of a rescan that reads one new local shard (bench/scale.py), so only a URL imports it."""

    open = staticmethod(open)
    isfile = staticmethod(os.path.isfile)
    exists = staticmethod(os.path.exists)

    @staticmethod
    def info(path: str) -> dict[str, Any]:
        st = os.stat(path)
        return {"size": st.st_size, "mtime": st.st_mtime}

    def find(self, path: str, detail: bool = True) -> dict[str, dict[str, Any]]:
        """Every file under `path` (linked folders not followed) and its info."""
        found = {}
        for top, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(FileNotFoundError):  # a dangling link is no shard
                    found[os.path.join(top, name)] = self.info(os.path.join(top, name))
        return found


def filesystem(location: str, options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a source: fsspec's for a URL (secrets come from the environment, as for
    ops.remote), LocalFiles for a local path."""
    if not is_url(location):
        return LocalFiles(), os.path.abspath(location)
    import fsspec

    return fsspec.core.url_to_fs(location, **storage_options(options))


def is_container(src: Source) -> bool:
    """A source the folder walk cannot read: an fsspec URL, a single shard file or a format other than folder."""
    return detect(src) != "folder"


def detect(src: Source) -> str:
    """The source's format: the configured one, else what the path holds when only one kind is there."""
    if src.format:
        return src.format
    ext = os.path.splitext(src.location.rstrip("/"))[1].lower()
    if ext in EXTENSIONS:
        return EXTENSIONS[ext]
    if not is_url(src.location):
        return _detect_folder(src)
    fs, path = filesystem(src.location, src.storage_options)
    kinds = {EXTENSIONS.get(os.path.splitext(p)[1].lower(), "other") for p in _find(fs, path, src)}
    return _one_kind(src, kinds)


def _detect_folder(src: Source) -> str:
    """A local folder: shards at its top level make it a shard source (a walk of 100k images is not needed)."""
    try:
        with os.scandir(src.root) as it:
            exts = {os.path.splitext(e.name)[1].lower() for e in it if not e.name.startswith(".") and e.is_file()}
    except OSError:
        return "folder"  # the scan names a missing folder with its fix
    kinds = {EXTENSIONS[e] for e in exts if e in EXTENSIONS}
    return _one_kind(src, kinds | ({"other"} if kinds and exts & set(IMAGE_EXTENSIONS) else set()))


def _one_kind(src: Source, kinds: set[str]) -> str:
    shards = kinds - {"other"}
    if len(shards) == 1 and "other" not in kinds:
        return next(iter(shards))
    if not shards:
        if is_url(src.location):
            raise StageFailed(
                f"{src.field} {src.location} holds no .tar or .parquet file: object storage is read as "
                f"webdataset shards or parquet tables; upload them there, or point {src.field} at a local folder"
            )
        return "folder"
    found = ", ".join(sorted(k if k != "other" else "image files" for k in kinds))
    raise StageFailed(
        f"{src.field} {src.location} holds several kinds of data ({found}): set its `format` "
        f"(folder | webdataset | parquet) in the config, or keep one kind per source"
    )


def _find(fs, path: str, src: Source) -> list[str]:
    try:
        return sorted(fs.find(path))
    except (OSError, ValueError) as err:
        raise StageFailed(
            f"{src.field} {src.location} cannot be listed ({type(err).__name__}: {err}): check the URL, "
            f"its storage_options and the credentials in the environment"
        ) from None


def identity(info: dict) -> str:
    """Size plus the store's checksum of the object, or its modification time where the store has none."""
    check = next((str(info[k]) for k in CHECKSUM_KEYS if info.get(k)), None)
    if check is None:
        check = f"mtime:{info.get('mtime') or info.get('LastModified') or info.get('updated') or ''}"
    return f"{info.get('size')}:{check.strip(chr(34))}"


def list_shards(src: Source, fmt: str) -> list[ShardFile]:
    """Every shard of the source (sorted), with its identity; none is opened."""
    fs, path = filesystem(src.location, src.storage_options)
    ext = next(e for e, f in EXTENSIONS.items() if f == fmt)
    try:
        if fs.isfile(path):
            return [_shard(fs, "", path)]
        found = fs.find(path, detail=True)
    except (OSError, ValueError) as err:
        raise StageFailed(
            f"{src.field} {src.location} cannot be listed ({type(err).__name__}: {err}): check the path, its "
            f"storage_options and the credentials in the environment"
        ) from None
    if not found and not fs.exists(path):
        raise StageFailed(f"{src.field} {src.location} does not exist: point it at your {fmt} files")
    base = path.rstrip("/")
    out = [
        ShardFile(posixpath.relpath(p, base), p, int(info.get("size") or 0), identity(info))
        for p, info in sorted(found.items())
        if p.lower().endswith(ext) and not posixpath.basename(p).startswith(".")
    ]
    if not out:
        raise StageFailed(
            f"{src.field} {src.location} holds no {ext} file: write the {fmt} files there, or set its "
            f"`format` to what it holds"
        )
    return out


def _shard(fs, rel: str, path: str) -> ShardFile:
    info = fs.info(path)
    return ShardFile(rel, path, int(info.get("size") or 0), identity(info))


def shard_location(root: Path | Location, shard: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a record's shard under the root a scan manifest names (ScanManifest.roots)."""
    if isinstance(root, Location):
        fs, base = filesystem(root.url, root.options)
        return fs, f"{base.rstrip('/')}/{shard}" if shard else base
    import fsspec

    from tuneline.stages.common.artifacts import safe_join

    return fsspec.filesystem("file"), str(safe_join(root, shard) if shard else root)
