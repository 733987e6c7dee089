"""Lineage of the artifact store: every published version with the upstream versions it was built from.

Read straight from the manifests (stage-agnostic: only the fields every manifest carries), so it works for
versions written by older code and never needs the stage definitions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tuneline.stages.common.artifacts import MANIFEST, ArtifactStore


@dataclass
class Version:
    stage: str
    version: str
    path: Path
    created_at: str
    upstream: dict[str, str] = field(default_factory=dict)
    fresh: bool = False
    initialized_from: str | None = None  # train.init_from previous: the train version whose weights it continued

    def as_json(self) -> dict:
        return {
            "stage": self.stage,
            "version": self.version,
            "fresh": self.fresh,
            "upstream": self.upstream,
            "initialized_from": self.initialized_from,
            "created_at": self.created_at,
            "path": str(self.path),
        }

    def upstream_text(self) -> str:
        return ", ".join(f"{s} {v}" for s, v in self.upstream.items()) or "-"


def read_version(path: Path) -> Version:
    """The lineage facts of one published version; an unreadable manifest gives an empty upstream."""
    try:
        raw = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    upstream = raw.get("upstream") if isinstance(raw.get("upstream"), dict) else {}
    init = raw.get("initialized_from")
    return Version(
        stage=path.parent.name,
        version=path.name,
        path=path,
        created_at=str(raw.get("created_at", "?")),
        upstream=dict(upstream),
        initialized_from=init if isinstance(init, str) else None,
    )


def lineage(store: ArtifactStore, stages: list[str], fresh: dict[str, str | None]) -> list[Version]:
    """Every published version, stages in pipeline order, oldest first; `fresh` marks the current ones."""
    out = []
    for stage in stages:
        for path in store.versions(stage):
            v = read_version(path)
            v.fresh = fresh.get(stage) == v.version
            out.append(v)
    return out
