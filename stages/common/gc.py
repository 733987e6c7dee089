"""Housekeeping: keep the newest K published versions per stage, and always what the current config uses.

Protected, whatever K: every fresh version and, transitively, every version a protected one was built from
(a fresh downstream never loses its upstream, nor a train run with init_from previous the run it continued). A removed version is first renamed to a dot-name, which is
not a published version (docs/design.md), then deleted: a gc killed halfway never leaves a half-deleted
directory that still looks published. Callers hold the store lock, so no stage is writing meanwhile.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.stages.common.artifacts import ArtifactStore
from tuneline.stages.common.lineage import read_version
from tuneline.stages.common.lock import is_in_use

TRASH_SUFFIX = ".gc"


@dataclass
class GcPlan:
    keep: dict[Path, str] = field(default_factory=dict)  # path -> why it is kept
    remove: list[Path] = field(default_factory=list)
    partial: list[Path] = field(default_factory=list)  # work in progress of interrupted runs
    trash: list[Path] = field(default_factory=list)  # left by a gc that was killed: always deleted


def protected(store: ArtifactStore, fresh: dict[str, str | None]) -> dict[tuple[str, str], str]:
    """(stage, version) -> reason, for the fresh versions and everything upstream of them, plus the train
    version a protected train run continued from (its key names it). That one is kept, but not what it was
    built from: a retraining schedule would otherwise keep every run it ever made."""
    out: dict[tuple[str, str], str] = {}
    followed: set[tuple[str, str]] = set()
    todo = [(s, v, "fresh", True) for s, v in fresh.items() if v]
    while todo:
        stage, version, why, follow = todo.pop()
        out.setdefault((stage, version), why)
        path = store.version_dir(stage, version)
        if not follow or (stage, version) in followed or not path.is_dir():
            continue
        followed.add((stage, version))
        v = read_version(path)
        todo += [(s, u, f"used by fresh {stage} {version}", True) for s, u in v.upstream.items()]
        if v.initialized_from:
            todo.append((stage, v.initialized_from, f"continued by {stage} {version}", False))
    return out


def plan(store: ArtifactStore, stages: list[str], fresh: dict[str, str | None], keep: int) -> GcPlan:
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    guard = protected(store, fresh)
    out = GcPlan()
    for stage in stages:
        versions = store.versions(stage)  # oldest first
        newest = set(versions[len(versions) - keep :]) if keep else set()
        for path in versions:
            why = guard.get((stage, path.name)) or ("among the newest kept" if path in newest else None)
            if why:
                out.keep[path] = why
            else:
                out.remove.append(path)
        d = store.stage_dir(stage)
        hidden = sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith(".")) if d.is_dir() else []
        out.trash += [p for p in hidden if p.name.endswith(TRASH_SUFFIX)]
        # A running multi-node training holds no store lock (only publishing does): its folder says it is in use.
        out.partial += [p for p in hidden if not p.name.endswith(TRASH_SUFFIX) and not is_in_use(p)]
        out.partial += stale_launch_files(d) if d.is_dir() else []
    return out


LAUNCH_FILE = re.compile(r"^(\..+\.partial)\.(spec|seen|stop)-[0-9a-f]+\.json$")


def stale_launch_files(stage_dir: Path) -> list[Path]:
    """Files a killed training launch left beside its work folder (`.<key>.partial.spec-<token>.json`): stale
    when no training uses that folder any more."""
    out = []
    for f in sorted(stage_dir.glob(".*.partial.*-*.json")):
        m = LAUNCH_FILE.match(f.name)
        if m and f.is_file() and not is_in_use(stage_dir / m.group(1)):
            out.append(f)
    return out


def collect(p: GcPlan, *, partial: bool = False) -> int:
    """Delete what the plan removes (and interrupted work in progress if asked); returns bytes freed."""
    freed = 0
    for path in p.trash:
        freed += tree_bytes(path)
        shutil.rmtree(path)
    for path in p.remove + (p.partial if partial else []):
        if path.is_file():  # a launch's leftover file
            freed += path.stat().st_size
            path.unlink()
            continue
        freed += tree_bytes(path)
        trash = path.with_name(f"{'' if path.name.startswith('.') else '.'}{path.name}{TRASH_SUFFIX}")
        os.replace(path, trash)
        shutil.rmtree(trash)
    return freed


def tree_bytes(path: Path) -> int:
    """What deleting `path` gives back: a file that a kept version still links (a latent chunk file an incremental
    build shared, tuneline.stages.latents.store.link_block) frees nothing."""
    return sum(st.st_size for f in path.rglob("*") if f.is_file() and (st := f.stat()).st_nlink == 1)
