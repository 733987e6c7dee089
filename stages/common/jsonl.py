"""JSON-lines read/write for the small per-image tables artifacts carry."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from pydantic import BaseModel

from tuneline.schemas.base import is_url


def write_jsonl(path: Path, rows: Iterable[BaseModel | dict]) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            data = row.model_dump(mode="json") if isinstance(row, BaseModel) else row
            f.write(json.dumps(data, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: Path | str, storage_options: dict | None = None) -> Iterator[dict]:
    """Rows of a JSON-lines file, local or (a URL with storage_options) remote, streamed line by line."""
    with _open_text(str(path), storage_options) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None


def _open_text(path: str, storage_options: dict | None):
    """A local file without fsspec: importing it is a tenth of a one-shard rescan's CPU time (bench/scale.py)."""
    if not is_url(path):
        return open(path, encoding="utf-8")
    import fsspec

    return fsspec.open(path, "rt", encoding="utf-8", **(storage_options or {}))
