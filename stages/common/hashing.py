"""Content fingerprints: canonical JSON and file hashes."""

from __future__ import annotations

import hashlib
import json
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


class HashCache:
    """File SHA-256s remembered on disk by (absolute path, size, mtime_ns): a process that identifies an unchanged
    7 GB model folder reads no weights. A changed file (new size or mtime) is hashed again. Writes are atomic
    renames, so concurrent processes at worst hash a file twice.

    A process parses the file once while it is unchanged (a run identifies several components, each through a new
    HashCache), and a save drops the entries of files that no longer exist: the cache is per user and outlives
    every workdir, so without that it grows with each model folder ever identified (seen: 44,000 entries, 9 MB
    parsed by each identification)."""

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
            return seen[1]  # shared: each entry is checked against its file when used
        try:
            known = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}
        # Anything of another shape (`[]`, a truncated or hand-edited file) is discarded: it is only a cache.
        known = known if isinstance(known, dict) else {}
        HashCache._read[self.path] = (stamp, known)
        return known

    def sha256(self, file: Path) -> str:
        st = file.stat()
        key = str(file.resolve())
        hit = self.known.get(key)
        if (
            isinstance(hit, list)
            and len(hit) == 3
            and hit[:2] == [st.st_size, st.st_mtime_ns]
            and isinstance(hit[2], str)
        ):
            return hit[2]
        sha = file_sha256(file)
        self.known[key] = [st.st_size, st.st_mtime_ns, sha]
        self.dirty = True
        return sha

    def save(self) -> None:
        if not self.dirty:
            return
        import os

        self.known = {k: v for k, v in self.known.items() if os.path.exists(k)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.known), encoding="utf-8")
        os.replace(tmp, self.path)
        st = self.path.stat()
        HashCache._read[self.path] = ((st.st_ino, st.st_size, st.st_mtime_ns), self.known)
        self.dirty = False
