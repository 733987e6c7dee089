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
