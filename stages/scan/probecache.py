"""The scan's memory of the files it read: a file whose size and mtime match is not reopened."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tuneline.schemas.scan import ScanManifest
from tuneline.schemas.sources import Source
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl
from tuneline.stages.scan.images import Probe

T = TypeVar("T")


def _cache_path(ctx, root: Path) -> Path:
    # Lives beside the versions, not in one: a rescan that finds identical content publishes nothing new,
    # yet its fresh mtimes must still be remembered or every later scan would reread those files.
    return ctx.store.stage_dir("scan") / f".probes-{digest([str(root), code_version('scan')])}.jsonl"


def _previous_root(ctx, src: Source) -> Path | None:
    """The folder the latest scan read this source from, if another: a moved dataset keeps its probes."""
    latest = ctx.store.latest("scan")
    if latest is None:
        return None
    try:
        root = ScanManifest.model_validate_json((latest / "manifest.json").read_bytes()).roots().get(src.index)
    except (OSError, ValueError):
        return None
    return root if root != src.root else None


def load_probe_cache(ctx, src: Source) -> dict[str, Probe]:
    """Probes from the last scan of this folder by this code (or of the folder it was moved from: a probe is
    reused only at the same relative path, size and mtime); anything unreadable means a cold scan."""
    path = _cache_path(ctx, src.root)
    if not path.is_file() and (moved := _previous_root(ctx, src)) is not None:
        path = _cache_path(ctx, moved)
    return {p.path: p for p in load_rows(ctx, path, lambda row: Probe(**row), "every file is read")}


def load_rows(ctx, path: Path, make: Callable[[dict], T], cold: str) -> list[T]:
    """A scan cache's rows, made into objects; anything unreadable means a cold scan (`cold` says what then)."""
    if not path.is_file():
        return []
    try:
        return [make(row) for row in read_jsonl(path)]
    except (OSError, ValueError, TypeError, KeyError) as err:
        ctx.log.warning("scan: ignoring the cache %s (%s); %s", path, err, cold)
        return []


def save_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_jsonl(tmp, rows)
    os.replace(tmp, path)  # atomic: a killed scan leaves the previous cache, never half of one


def save_probe_cache(ctx, root: Path, probes: list[Probe]) -> None:
    # A video an image family refused unread is not a probe: a video family must read it.
    save_rows(_cache_path(ctx, root), [p.as_json() for p in probes if p.kind != "video"])
