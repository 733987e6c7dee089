"""Artifact versions on object storage (S3 and anything else fsspec speaks): push, pull, list.

The remote layout mirrors the local store: `<remote>/<stage>/<version>/<files>` + `manifest.json`. Object
stores have no rename, so push uploads the manifest last: a remote version counts as published only once
its manifest is there, and an interrupted push is simply redone. Pull downloads into a dot-directory (never a
published version, docs/design.md), checks every file's size and SHA-256 against the remote manifest, writes
the manifest last and renames the directory into place, exactly like a local publish.
Versions are immutable (same fingerprint, same content), so a version already present is never re-sent.
A consumer may also read a version in place (the training reader does): read_remote_manifest checks it first.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tuneline.schemas.base import FileEntry
from tuneline.stages.common.artifacts import (
    MANIFEST,
    ArtifactError,
    ArtifactStore,
    M,
    file_problem,
    parse_manifest,
    safe_join,
)

OPTIONS_ENV = "TUNELINE_REMOTE_OPTIONS"


class RemoteError(RuntimeError):
    """A remote version is missing, incomplete or does not match its manifest; the message names it."""


def storage_options(configured: dict[str, Any] | None = None) -> dict[str, Any]:
    """Config options (non-secret: endpoint, region) overlaid with TUNELINE_REMOTE_OPTIONS (JSON, secrets)."""
    opts = dict(configured or {})
    raw = os.environ.get(OPTIONS_ENV)
    if raw:
        try:
            opts.update(json.loads(raw))
        except ValueError as err:
            raise RemoteError(
                f'{OPTIONS_ENV} is not valid JSON ({err}); expected e.g. {{"key": "...", "secret": "..."}}'
            ) from None
    return opts


class Remote:
    def __init__(self, url: str, options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self.options = storage_options(options)
        import fsspec  # here: a local scan imports this module for storage_options and never opens a URL

        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.options)

    def version_url(self, stage: str, version: str) -> str:
        """The fsspec URL of a remote version (what zarr/fsspec readers open, with `self.options`)."""
        return f"{self.url}/{stage}/{version}"

    def _path(self, stage: str, version: str, rel: str = "") -> str:
        base = f"{self.root.rstrip('/')}/{stage}/{version}"
        return f"{base}/{rel}" if rel else base

    def has(self, stage: str, version: str) -> bool:
        path = self._path(stage, version, MANIFEST)
        self.fs.invalidate_cache(self._path(stage, version))
        return self.fs.exists(path)

    def versions(self, stage: str) -> list[str]:
        """Published remote versions of a stage (those whose manifest arrived), sorted by name."""
        base = f"{self.root.rstrip('/')}/{stage}"
        self.fs.invalidate_cache(base)
        if not self.fs.exists(base):
            return []
        names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(base, detail=False))
        return [n for n in names if not n.startswith(".") and self.has(stage, n)]

    def push(self, store: ArtifactStore, stage: str, version: str) -> bool:
        """Upload a local published version; False when the remote already has it."""
        if self.has(stage, version):
            return False
        local = store.version_dir(stage, version)
        manifest = _load_manifest((local / MANIFEST).read_bytes(), str(local), stage, version)
        for entry in manifest["files"]:
            src = safe_join(local, entry["path"])
            # Never publish a corrupt copy: the remote is what other machines trust.
            _check_file(src, entry, f"local artifact {local}")
            self._parents(self._path(stage, version, entry["path"]))
            self.fs.put_file(str(src), self._path(stage, version, entry["path"]))
        self._parents(self._path(stage, version, MANIFEST))
        self.fs.pipe_file(self._path(stage, version, MANIFEST), (local / MANIFEST).read_bytes())
        return True

    def _parents(self, path: str) -> None:
        """A filesystem with real folders (file://, mounted shares) needs them made; object stores have none (and
        their makedirs could create buckets)."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        if {"file", "local"} & set(protocols):
            self.fs.makedirs(self.fs._parent(path), exist_ok=True)

    def pull(self, store: ArtifactStore, stage: str, version: str) -> Path:
        """Download a remote version into the local store (verified); a local copy is kept as is."""
        final = store.version_dir(stage, version)
        if (final / MANIFEST).is_file():
            return final
        where = self.version_url(stage, version)
        if not self.has(stage, version):
            raise _unpublished(where)
        raw = self.fs.cat_file(self._path(stage, version, MANIFEST))
        manifest = _load_manifest(raw, where, stage, version)
        work = store.stage_dir(stage) / f".{version}.pull"
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        try:
            for entry in manifest["files"]:
                dst = safe_join(work, entry["path"])
                dst.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(self._path(stage, version, entry["path"]), str(dst))
                _check_file(dst, entry, f"remote version {where}")
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)  # a failed pull leaves nothing that could be trusted
            raise
        (work / MANIFEST).write_bytes(raw)
        os.replace(work, final)
        return final

    def signed_url(self, stage: str, version: str, rel: str, expires: int = 7 * 86400) -> str | None:
        """A browser-reachable URL for one file, where the backend can sign one (S3, GCS); else None."""
        try:
            return self.fs.sign(self._path(stage, version, rel), expiration=expires)
        except NotImplementedError:
            return None


def read_remote_manifest(url: str, cls: type[M], options: dict[str, Any] | None = None) -> M:
    """Parse and check a remote version read in place: what ArtifactStore.read checks, file sizes standing in
    for checksums.

    Hashing would download every file, which reading in place exists to avoid; a wrong size still catches an
    object edited or replaced since the push, the manifest arriving last catches an interrupted push, and
    `pull` verifies every checksum. `options` are the storage options (Remote.options); `url` ends in <stage>/<version>.
    """
    url = url.rstrip("/")
    stage, version = url.rsplit("/", 2)[-2:]
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache(root)  # a listing cached before a re-push would report stale sizes
    try:
        raw = fs.cat_file(f"{root}/{MANIFEST}")
    except FileNotFoundError:
        raise _unpublished(url) from None
    manifest = _load_manifest(raw, url, stage, version, cls)
    sizes = {path[len(root) + 1 :]: info["size"] for path, info in fs.find(root, detail=True).items()}
    for entry in manifest.files:
        got = sizes.get(entry.path)
        if got != entry.bytes:
            has = "is missing" if got is None else f"has {got} bytes"
            raise RemoteError(
                f"remote version {url}: file {entry.path} {has}, its manifest says {entry.bytes} "
                f"(edited or overwritten since its push); remove the remote version and push it again"
            )
    return manifest


def _unpublished(where: str) -> RemoteError:
    return RemoteError(
        f"remote version {where} has no {MANIFEST}: it was never pushed or its push was "
        f"interrupted; push it again from the machine that built it (`tuneline remote push`)"
    )


def _load_manifest(raw: bytes, where: str, stage: str, version: str, cls: type[M] | None = None):
    """The store's own manifest checks, reported as a remote problem."""
    try:
        return parse_manifest(raw, where, stage, version, cls, "push it again from the machine that built it")
    except ArtifactError as err:
        raise RemoteError(str(err)) from None


def _check_file(path: Path, entry: dict, where: str) -> None:
    """The store's own per-file check (size, then SHA-256 always), reported as a remote problem."""
    problem = file_problem(path, FileEntry.model_validate(entry), always_hash=True, checksum="SHA-256 checksum")
    if problem:
        raise RemoteError(f"{where}: {problem}")
