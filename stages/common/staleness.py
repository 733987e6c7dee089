"""Why a stage's published version is not the fresh one: the status reason, named change by change (code version,
config and input fields, upstream versions), or the problem its manifest has."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneline.stages.common.artifacts import ArtifactError, fix_hint

if TYPE_CHECKING:
    from tuneline.stages.common.stage import StageContext, StageDef


def diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new)):
            out += diff(old.get(k), new.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def problem(err: ArtifactError, stage: str) -> str:
    """What is wrong, without the rebuild hint: a status reason says why, and a refusal quoting it names its one
    fix itself (a tampered captions.jsonl once read "run `... --force` ...); run `tuneline stage caption` first")."""
    return str(err).removesuffix(f"; {fix_hint(stage)}")


def stale_reason(ctx: StageContext, sd: StageDef, latest: Path, parts: dict | None) -> str:
    try:
        m = ctx.store.read(latest, sd.manifest_cls)
    except ArtifactError as err:
        return problem(err, sd.name)
    if parts is None:
        ups = ", ".join(sd.upstream)
        return f"upstream ({ups}) is not fresh: rebuild it first"
    changes = []
    if m.code_version != parts["code_version"]:
        changes.append(f"code version {m.code_version} -> {parts['code_version']}")
    changes += [f"config {c}" for c in diff(m.config, parts["config"], "")]
    named = sd.explain(ctx, m, parts["inputs"]) if sd.explain is not None else None
    changes += named if named is not None else [f"input {c}" for c in diff(m.inputs, parts["inputs"], "")]
    changes += [f"upstream {u} changed" for u in sd.upstream if m.upstream.get(u) != parts["upstream"].get(u)]
    return "; ".join(changes[:6]) or "inputs changed"
