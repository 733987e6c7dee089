"""The artifact store: `<workdir>/artifacts/<stage>/<version>/` published atomically, manifest written last.

A version directory exists only once complete: stages build in `artifacts/<stage>/.<version>.partial/`
(kept across crashes so a rerun can resume finished blocks) and `os.replace` it into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from tuneline.schemas.base import MANIFEST_SCHEMA_VERSION, FileEntry, Manifest
from tuneline.stages.common.hashing import canonical_json, file_sha256

M = TypeVar("M", bound=Manifest)

MANIFEST = "manifest.json"
FAILURE = ".failed.json"
# Small files are re-hashed by every consumer; large data files are checked by size (a truncated chunk
# is caught) unless a full verification is asked for.
HASH_ON_READ_LIMIT = 4 << 20


class ArtifactError(RuntimeError):
    """An artifact is missing, stale or fails its checks; the message names it and the fixing command."""


def fix_hint(stage: str) -> str:
    return f"run `tuneline stage {stage} --force` (or `tuneline run`) to rebuild it"


class ArtifactStore:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.root = self.workdir / "artifacts"

    # Layout ----------------------------------------------------------------------------------
    def stage_dir(self, stage: str) -> Path:
        return self.root / stage

    def version_dir(self, stage: str, version: str) -> Path:
        return self.stage_dir(stage) / version

    def partial_dir(self, stage: str, version: str) -> Path:
        return self.stage_dir(stage) / f".{version}.partial"

    def versions(self, stage: str) -> list[Path]:
        """Published versions, oldest first (by manifest mtime: manifests are written last)."""
        d = self.stage_dir(stage)
        if not d.is_dir():
            return []
        restore_replaced(d)
        found = [p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).is_file()]
        return sorted(found, key=lambda p: ((p / MANIFEST).stat().st_mtime_ns, p.name))

    def latest(self, stage: str) -> Path | None:
        v = self.versions(stage)
        return v[-1] if v else None

    # Reading ---------------------------------------------------------------------------------
    def read(self, path: Path, cls: type[M], *, full: bool = False) -> M:
        """Parse and verify a published version: manifest (schema version, own digest, fields, location), files."""
        path = Path(path)
        stage = path.parent.name
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise ArtifactError(f"artifact {path} has no {MANIFEST}: it is not a published version; {fix_hint(stage)}")
        manifest = parse_manifest(mpath.read_bytes(), f"artifact {path}", stage, path.name, cls, fix_hint(stage))
        self._verify_files(path, manifest, full=full)
        return manifest

    def _verify_files(self, path: Path, manifest: Manifest, *, full: bool) -> None:
        for entry in manifest.files:
            problem = file_problem(safe_join(path, entry.path), entry, always_hash=full)
            if problem:
                raise ArtifactError(f"artifact {path}: {problem}; {fix_hint(manifest.stage)}")

    # Writing ---------------------------------------------------------------------------------
    def start(self, stage: str, version: str, *, resume: bool = True) -> Path:
        """The work-in-progress directory for a version; kept (resumable) unless resume is False."""
        work = self.partial_dir(stage, version)
        if work.exists() and not resume:
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
        return work

    def publish(self, work: Path, manifest: M) -> Path:
        """List every file with size + checksum, write the manifest last, fsync, rename into place."""
        stage, version = manifest.stage, manifest.fingerprint
        final = self.version_dir(stage, version)
        manifest.files = list_files(work)
        data = manifest.model_dump(mode="json")
        data["digest"] = manifest_digest(data)
        mpath = work / MANIFEST
        tmp = work / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
        fsync_file(tmp)
        os.replace(tmp, mpath)
        _fsync_dir(work)
        if final.exists():
            # A rebuild of a version that failed its checks (`--force`): swap it in atomically, so a kill at any
            # moment leaves the old version or the new one, never neither and never a mix.
            replace_dir(work, final)
        else:
            os.replace(work, final)
        _fsync_dir(final.parent)
        self.clear_failure(stage)
        return final

    # Failures --------------------------------------------------------------------------------
    def record_failure(
        self, stage: str, version: str | None, error: str, key: str | None = None, state: str = "failed"
    ) -> None:
        """The last attempt's end: `failed`, or `stopped` on request with its progress saved."""
        d = self.stage_dir(stage)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{FAILURE}.tmp"
        tmp.write_text(
            json.dumps({"version": version, "key": key, "error": error, "at": time.time(), "state": state}),
            encoding="utf-8",
        )
        os.replace(tmp, d / FAILURE)

    def last_failure(self, stage: str) -> dict | None:
        f = self.stage_dir(stage) / FAILURE
        try:
            return json.loads(f.read_text(encoding="utf-8"))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def clear_failure(self, stage: str) -> None:
        (self.stage_dir(stage) / FAILURE).unlink(missing_ok=True)


def manifest_digest(data: dict) -> str:
    """SHA-256 of a manifest's content without its own `digest` field: an edited fact is caught on read even
    though the files it lists are intact."""
    return hashlib.sha256(canonical_json({k: v for k, v in data.items() if k != "digest"}).encode()).hexdigest()


def parse_manifest(raw: bytes, where: str, stage: str, version: str, cls: type[M] | None, hint: str):
    """Check manifest bytes found at `where` for <stage>/<version>: JSON, schema version, own digest, location,
    and (with `cls`) every field. Returns the model, or the checked dict when `cls` is None."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{where}: {MANIFEST} is not valid JSON ({err}); {hint}") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{where}: {MANIFEST} is not a JSON object; {hint}")
    sv = data.get("schema_version")
    if sv != MANIFEST_SCHEMA_VERSION:
        raise ArtifactError(
            f"{where}: manifest schema_version {sv!r} is not one this tuneline knows "
            f"({MANIFEST_SCHEMA_VERSION}); {hint}"
        )
    if data.get("digest") != manifest_digest(data):
        raise ArtifactError(
            f"{where}: {MANIFEST} does not match its own digest (edited after it was published); {hint}"
        )
    if data.get("stage") != stage or data.get("fingerprint") != version:
        raise ArtifactError(
            f"{where}: manifest says stage {data.get('stage')!r} version {data.get('fingerprint')!r}, "
            f"which is not where it lies; {hint}"
        )
    if cls is None:
        return data
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ArtifactError(f"{where}: manifest field {loc}: {first['msg']}; {hint}") from None


def safe_join(root: Path, rel: str) -> Path:
    """Join a path taken from a manifest or caption file, refusing anything that escapes `root`."""
    p = (root / rel).resolve()
    if not p.is_relative_to(root.resolve()):
        raise ArtifactError(f"path {rel!r} in {root} points outside it; refusing to read it")
    return p


def file_problem(path: Path, entry: FileEntry, *, always_hash: bool, checksum: str = "checksum") -> str | None:
    """What is wrong with one listed file, or None. Size always; checksum for small files or when asked."""
    if not path.is_file():
        return f"file {entry.path} is missing"
    size = path.stat().st_size
    if size != entry.bytes:
        return f"file {entry.path} has {size} bytes, the manifest says {entry.bytes} (truncated or edited)"
    if (always_hash or size <= HASH_ON_READ_LIMIT) and file_sha256(path) != entry.sha256:
        return f"file {entry.path} does not match its {checksum} (edited or corrupt)"
    return None


def list_files(root: Path) -> list[FileEntry]:
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, f".{MANIFEST}.tmp"):
            rel = p.relative_to(root).as_posix()
            out.append(FileEntry(path=rel, bytes=p.stat().st_size, sha256=file_sha256(p)))
    return out


RENAME_EXCHANGE = 2


def replace_dir(new: Path, target: Path) -> None:
    """Put directory `new` at `target` (which exists) atomically, then delete the old content.

    Linux's renameat2(RENAME_EXCHANGE) swaps the two names in one step. Where the filesystem lacks it, the old
    directory is renamed aside to `.<name>.old` first and `restore_replaced` puts it back if a kill lands between
    the two renames. Either way the old content ends under a hidden name that is never mistaken for work in
    progress, and is deleted."""
    staged, aside = (target.parent / f".{target.name}.{s}" for s in ("new", "old"))
    for leftover in (staged, aside):
        if leftover.exists():
            shutil.rmtree(leftover)
    os.replace(new, staged)
    if _exchange(staged, target):
        shutil.rmtree(staged)  # now the old content
        return
    os.replace(target, aside)
    os.replace(staged, target)
    shutil.rmtree(aside)


def restore_replaced(stage_dir: Path) -> None:
    """Undo a replace_dir interrupted between its two renames (old content aside, nothing in place)."""
    for aside in stage_dir.glob(".*.old"):
        target = stage_dir / aside.name[1:].removesuffix(".old")
        if not target.exists():
            os.replace(aside, target)


def _exchange(a: Path, b: Path) -> bool:
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), RENAME_EXCHANGE)  # -100: AT_FDCWD
    except (AttributeError, OSError):
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fsync_file(path)
    except OSError:  # some filesystems refuse directory fsync; the rename is still atomic
        pass
