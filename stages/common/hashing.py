"""Content fingerprints: canonical JSON and file hashes."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any, length: int = 16) -> str:
    """Short stable hash of any JSON-able value (versions are directory names, so keep them short)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


KEEP_DAYS = 30  # a file-hash cache entry unused this long is dropped at the next save


def _today() -> int:
    return int(time.time() // 86400)


class HashCache:
    """File SHA-256s remembered on disk by (absolute path, size, mtime_ns): a process that identifies an unchanged
    7 GB model folder reads no weights. A changed file (new size or mtime) is hashed again. Writes are atomic
    renames, so concurrent processes at worst hash a file twice.

    The cache is per user and outlives every workdir: each entry carries the day it was last used, and a save drops
    those unused for KEEP_DAYS, so it does not grow with every model folder ever identified (seen: 44,000 entries,
    9 MB). Not whether the file exists: a home folder shared by several machines holds entries of files on each
    machine's own disks. A process parses the file once while it is unchanged (a run identifies several
    components, each through a new HashCache)."""

    _read: dict[Path, tuple[tuple[int, int, int], dict]] = {}  # path -> (its stat when parsed, what it held)

    def __init__(self, path: Path):
        self.path = Path(path)
        self.known: dict[str, list] = self._load()
        self.dirty = False

    def _load(self) -> dict[str, list]:
        try:
            st = self.path.stat()
        except OSError:
            return {}
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        seen = HashCache._read.get(self.path)
        if seen is not None and seen[0] == stamp:
            return dict(seen[1])
        try:
            known = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
        # Anything of another shape (`[]`, a truncated or hand-edited file, an entry that is not [size, mtime,
        # sha, day]) is discarded: it is only a cache. Entries written before days were kept count from today.
        today = _today()
        known = {k: _entry(v, today) for k, v in known.items()} if isinstance(known, dict) else {}
        known = {k: v for k, v in known.items() if v is not None}
        HashCache._read[self.path] = (stamp, known)
        return dict(known)

    def sha256(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        hit = self.known.get(key)
        today = _today()
        if hit is not None and hit[:2] == [st.st_size, st.st_mtime_ns]:
            if hit[3] != today:  # dated once a day, not rewritten by every run
                self.known[key] = [*hit[:3], today]
                self.dirty = True
            return hit[2]
        sha = file_sha256(file)
        self.known[key] = [st.st_size, st.st_mtime_ns, sha, today]
        self.dirty = True
        return sha

    def save(self) -> None:
        if not self.dirty:
            return
        import os

        oldest = _today() - KEEP_DAYS
        self.known = {k: v for k, v in self.known.items() if v[3] >= oldest}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.known), encoding="utf-8")
        st = tmp.stat()  # a rename keeps it; after the rename the path may already be another process's file
        os.replace(tmp, self.path)
        HashCache._read[self.path] = ((st.st_ino, st.st_size, st.st_mtime_ns), dict(self.known))
        self.dirty = False


def _entry(value, today: int) -> list | None:
    """A cache entry as [size, mtime_ns, sha256, day last used], or None when it is of another shape."""
    if not isinstance(value, list) or len(value) not in (3, 4) or not isinstance(value[2], str):
        return None
    if not all(isinstance(v, int) for v in (*value[:2], *value[3:])):
        return None
    return [*value[:3], value[3] if len(value) == 4 else today]
