"""The scan's memory of the files it read: a file whose size and mtime match is not reopened."""

from __future__ import annotations

import os
from pathlib import Path

from tuneline.schemas.scan import ScanManifest
from tuneline.schemas.sources import Source
from tuneline.stages.common.codeident import code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.jsonl import read_jsonl, write_jsonl
from tuneline.stages.scan.images import Probe


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
    if not path.is_file():
        return {}
    try:
        return {row["path"]: Probe(**row) for row in read_jsonl(path)}
    except (OSError, ValueError, TypeError, KeyError) as err:
        ctx.log.warning("scan: ignoring the probe cache %s (%s); every file is read", path, err)
        return {}


def save_probe_cache(ctx, root: Path, probes: list[Probe]) -> None:
    path = _cache_path(ctx, root)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write_jsonl(tmp, [p.as_json() for p in probes])
    os.replace(tmp, path)  # atomic: a killed scan leaves the previous cache, never half of one
