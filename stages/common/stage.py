"""The stage runner: versions, freshness, upstream checks, publish. Pure Python (flows wrap it in Prefect).

A stage's *key* hashes everything it is built from (effective config, code version, input fingerprints,
upstream versions). Its *version* is the key, except for content-addressed stages (scan), whose version
hashes what they produced, so touching a file without changing it leaves every downstream stage fresh.
`.index.json` in the stage directory remembers key -> version.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import import_module
from pathlib import Path
from typing import Any

from tuneline.schemas.base import Manifest
from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore, fix_hint
from tuneline.stages.common.codeident import library_versions, stage_code_version
from tuneline.stages.common.hashing import digest
from tuneline.stages.common.report import Reporter
from tuneline.stages.common.staleness import problem, stale_reason

TOOL_VERSION = "0.1.0"
INDEX = ".index.json"


class StageFailed(RuntimeError):
    """A stage could not complete; nothing was published."""


class StageStopped(RuntimeError):
    """A stage stopped on request (SIGTERM, a cancelled run, a preemption) after saving its progress (a training's
    checkpoint): `status` shows it as stopped with this message, and a rerun continues."""


class PublishedElsewhere(Exception):
    """This process took part in the build, another one publishes it (a multi-node training's other nodes)."""

    def __init__(self, path: Path, why: str):
        super().__init__(why)
        self.path = path


@dataclass
class StageContext:
    cfg: PipelineConfig
    reporter: Reporter = field(default_factory=Reporter)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("tuneline"))
    force: bool = False
    cache: dict[str, Any] = field(default_factory=dict)
    # Held around publishing only; callers that hold the store lock for the whole stage leave it a no-op.
    publish_lock: Callable[[], Any] = contextlib.nullcontext

    @property
    def workdir(self) -> Path:
        return self.cfg.workdir_path()

    @property
    def store(self) -> ArtifactStore:
        return ArtifactStore(self.workdir)

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """Compute-once values shared by stages of one run (model folder, identities)."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


@dataclass(frozen=True)
class StageDef:
    name: str
    upstream: tuple[str, ...]
    code_version: str
    manifest_cls: type[Manifest]
    config: Callable[[PipelineConfig], dict]
    # inputs(ctx, upstream versions): fingerprints of what the stage reads besides its upstream artifacts
    inputs: Callable[[StageContext, dict[str, str]], dict]
    # build(ctx, work_dir, upstream manifests) -> the stage's own manifest facts
    build: Callable[[StageContext, Path, dict[str, Manifest]], dict]
    # check(ctx, upstream manifests): the facts this stage relies on match; raise ArtifactError otherwise
    check: Callable[[StageContext, dict[str, Manifest]], None] | None = None
    content_addressed: bool = False
    # content(ctx): for a content-addressed stage, the content digest its build would publish now, computed without
    # publishing (None when it cannot tell). Status asks it when the inputs' key is new (a touched file), so a
    # change that rebuilds nothing leaves every version the next run reuses fresh (and gc keeps them).
    content: Callable[[StageContext], str | None] | None = None
    # explain(ctx, manifest, inputs): how the inputs changed since that published version, in the stage's own
    # words (scan: the shards added, replaced, removed), or None for the field-by-field difference
    explain: Callable[[StageContext, Manifest, dict], list[str] | None] | None = None
    # enabled(cfg): whether the stage is part of this config's pipeline (None = always; caption: caption.model set)
    enabled: Callable[[PipelineConfig], bool] | None = None
    # Stages read only when they are on (text reads the caption stage's captions when it runs): then upstream.
    optional_upstream: tuple[str, ...] = ()


def built_by(module: str) -> Callable[[StageContext, Path, dict[str, Manifest]], dict]:
    """A stage's `build`: `module`'s build, imported when the stage runs, so torch and the models load only then
    (the stage definitions are read by every command, status and plan included)."""

    def build(ctx: StageContext, work: Path, upstream: dict[str, Manifest]) -> dict:
        return import_module(module).build(ctx, work, upstream)

    return build


def active(cfg: PipelineConfig, stages: list[StageDef]) -> list[StageDef]:
    """The stages this config runs, each with the optional upstreams that are on added to its upstream."""
    on = [s for s in stages if s.enabled is None or s.enabled(cfg)]
    names = {s.name for s in on}
    return [
        replace(s, upstream=s.upstream + tuple(u for u in s.optional_upstream if u in names))
        if s.optional_upstream
        else s
        for s in on
    ]


@dataclass
class StageStatus:
    stage: str
    state: str  # fresh | stale | missing | failed | stopped
    version: str | None
    path: str | None
    reason: str
    summary: str = ""

    def as_json(self) -> dict:
        return {
            "stage": self.stage,
            "state": self.state,
            "version": self.version,
            "path": self.path,
            "reason": self.reason,
        }


def _read_index(store: ArtifactStore, stage: str) -> dict[str, str]:
    try:
        return json.loads((store.stage_dir(stage) / INDEX).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_index(store: ArtifactStore, stage: str, key: str, version: str) -> None:
    idx = _read_index(store, stage)
    idx[key] = version
    d = store.stage_dir(stage)
    tmp = d / f"{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(idx, indent=1), encoding="utf-8")
    os.replace(tmp, d / INDEX)


def reusable_previous(ctx: StageContext, stage: str, cls: type[Manifest]) -> tuple[Path, Any] | None:
    """(path, manifest) of the stage's latest published version, for incremental builds to copy rows from;
    None with --force (trust nothing already built) or when that version fails its checks."""
    path = ctx.store.latest(stage)
    if path is None or ctx.force:
        return None
    try:
        return path, ctx.store.read(path, cls)
    except ArtifactError as err:
        ctx.log.warning("%s: not reusing %s: %s", stage, path, err)
        return None


def key_parts(ctx: StageContext, sd: StageDef, upstream: dict[str, str]) -> dict:
    inputs = sd.inputs(ctx, upstream) | {"libraries": library_versions(sd.name)}
    code_version = stage_code_version(sd.name, sd.code_version, ctx.cfg.model.family)  # + a bumped family's revision
    return {
        "stage": sd.name,
        "code_version": code_version,
        "config": sd.config(ctx.cfg),
        "inputs": inputs,
        "upstream": upstream,
    }


def content_version(sd: StageDef, code_version: str, content: str | None) -> str:
    """A content-addressed stage's version: settings that changed no output change no version."""
    return digest({"stage": sd.name, "code_version": code_version, "content": content})


def _predicted(ctx: StageContext, sd: StageDef, parts: dict) -> str | None:
    """The published version a rebuild of `sd` would republish (None: a rebuild makes something new)."""
    content = sd.content(ctx) if sd.content is not None else None
    if content is None:
        return None
    version = content_version(sd, parts["code_version"], content)
    return version if (ctx.store.version_dir(sd.name, version) / "manifest.json").is_file() else None


def expected_versions(
    ctx: StageContext, stages: list[StageDef], relisted: set[str] | None = None
) -> dict[str, tuple[str | None, dict | None]]:
    """Per stage: (the version the current config + inputs map to, or None if unknown; the key parts).

    With `relisted` (a set to fill), a content-addressed stage whose inputs' key is new gets the published version
    its rebuild would republish, and its name goes into the set: what the next run reuses, not what it runs."""
    out: dict[str, tuple[str | None, dict | None]] = {}
    for sd in stages:
        if sd.enabled is not None and not sd.enabled(ctx.cfg):
            continue  # a stage this config turns off has no version (caption without caption.model)
        ups = {u: out[u][0] for u in sd.upstream}
        if any(v is None for v in ups.values()):
            out[sd.name] = (None, None)
            continue
        parts = key_parts(ctx, sd, ups)  # type: ignore[arg-type]
        key = digest(parts)
        version = _read_index(ctx.store, sd.name).get(key) if sd.content_addressed else key
        if version is None and relisted is not None and (version := _predicted(ctx, sd, parts)):
            relisted.add(sd.name)
        out[sd.name] = (version, parts)
    return out


def status(ctx: StageContext, stages: list[StageDef], *, reuse: bool = False) -> list[StageStatus]:
    """Per stage, its state. With `reuse`, fresh means what the next run reuses: a scan whose listing changed
    (a touched file, a Thumbs.db, a moved folder) but whose rescan republishes a published version is fresh,
    and so is what was built from it (`tuneline status`, gc). Without it, fresh means a run skips the stage."""
    store = ctx.store
    stages = active(ctx.cfg, stages)
    relisted: set[str] = set()
    exp = expected_versions(ctx, stages, relisted if reuse else None)
    rows: list[StageStatus] = []
    for sd in stages:
        version, parts = exp[sd.name]
        fresh_dir = store.version_dir(sd.name, version) if version else None
        failure = store.last_failure(sd.name)
        if fresh_dir is not None and (fresh_dir / "manifest.json").is_file():
            try:
                m = store.read(fresh_dir, sd.manifest_cls)
            except ArtifactError as err:
                rows.append(StageStatus(sd.name, "stale", version, str(fresh_dir), problem(err, sd.name)))
                continue
            # Built from the right versions, but one of them no longer verifies: reading it would fail.
            bad = [r for r in rows if r.stage in sd.upstream and r.state != "fresh"]
            if bad:
                rows.append(
                    StageStatus(
                        sd.name,
                        "stale",
                        version,
                        str(fresh_dir),
                        f"upstream {bad[0].stage} is {bad[0].state}: {bad[0].reason}",
                    )
                )
                continue
            rows.append(StageStatus(sd.name, "fresh", version, str(fresh_dir), "up to date", _summary(m)))
            continue
        if failure is not None and (parts is None or failure.get("key") in (None, digest(parts))):
            rows.append(last_attempt(sd.name, failure))
            continue
        latest = store.latest(sd.name)
        if latest is None:
            rows.append(StageStatus(sd.name, "missing", None, None, "never built"))
            continue
        rows.append(StageStatus(sd.name, "stale", latest.name, str(latest), stale_reason(ctx, sd, latest, parts)))
    reused = ", ".join(f"{r.stage} {r.version}" for r in rows if r.state == "fresh")
    for r in rows:
        if r.stage in relisted and r.state == "fresh":
            r.reason = f"listing changed; the next run rescans and reuses {reused}"
    return rows


def last_attempt(stage: str, failure: dict) -> StageStatus:
    """A stage whose last attempt ended unpublished: stopped (with a checkpoint; a rerun continues) or failed."""
    error = failure.get("error", "?")
    if failure.get("state") == "stopped":
        return StageStatus(stage, "stopped", failure.get("version"), None, error)
    return StageStatus(stage, "failed", failure.get("version"), None, f"last attempt failed: {error}")


def _summary(m: Manifest) -> str:
    facts = m.model_dump(include={"accepted", "rejected", "count", "step"})
    return ", ".join(f"{k} {v}" for k, v in facts.items())


def load_upstream(
    ctx: StageContext, sd: StageDef, by_name: dict[str, StageDef], versions: dict[str, str]
) -> dict[str, Manifest]:
    """Read and verify each upstream artifact this stage consumes, or refuse naming it and the fix."""
    got: dict[str, Manifest] = {}
    for u in sd.upstream:
        v = versions.get(u)
        udef = by_name[u]
        if v is None or not ctx.store.version_dir(u, v).is_dir():
            latest = ctx.store.latest(u)
            what = (
                "missing"
                if latest is None
                else f"stale (latest {latest.name} does not match the current config/inputs)"
            )
            raise ArtifactError(
                f"stage {sd.name} needs the {u} artifact, which is {what}; "
                f"run `tuneline stage {u}` (or `tuneline run`) first"
            )
        m = ctx.store.read(ctx.store.version_dir(u, v), udef.manifest_cls)
        got[u] = m
    return got


def run_stage(ctx: StageContext, sd: StageDef, stages: list[StageDef]) -> tuple[Path, bool]:
    """Build `sd` unless a fresh version exists. Returns (artifact dir, built?)."""
    by_name = {s.name: s for s in active(ctx.cfg, stages)}
    if sd.enabled is not None and not sd.enabled(ctx.cfg):
        raise StageFailed(f"stage {sd.name} is off in this config (it runs when {sd.name}.model is set)")
    sd = by_name.get(sd.name, sd)
    chain = _chain(sd, by_name)
    exp = expected_versions(ctx, chain)
    ctx.cache["expected"] = {name: v for name, (v, _) in exp.items()}  # for checks that must name the culprit
    version, parts = exp[sd.name]
    store = ctx.store
    if parts is None:
        load_upstream(ctx, sd, by_name, {u: exp[u][0] for u in sd.upstream})  # raises naming the culprit
        raise ArtifactError(f"stage {sd.name}: upstream is not fresh; run `tuneline run`")
    key = digest(parts)
    if version and not ctx.force and (store.version_dir(sd.name, version) / "manifest.json").is_file():
        try:
            store.read(store.version_dir(sd.name, version), sd.manifest_cls)
            ctx.log.info("%s: fresh (%s), skipped", sd.name, version)
            return store.version_dir(sd.name, version), False
        except ArtifactError as err:
            ctx.log.warning("%s: published version fails its checks, rebuilding: %s", sd.name, err)
    try:
        upstream = load_upstream(ctx, sd, by_name, parts["upstream"])
        if sd.check:
            sd.check(ctx, upstream)
        work = store.start(sd.name, key)
        facts = sd.build(ctx, work, upstream)
        content = facts.pop("content_digest", None)
        version = content_version(sd, parts["code_version"], content) if sd.content_addressed else key
        manifest = sd.manifest_cls(
            stage=sd.name,
            fingerprint=version,
            upstream=parts["upstream"],
            tool_version=TOOL_VERSION,
            code_version=parts["code_version"],
            config=parts["config"],
            inputs=parts["inputs"],
            **facts,
        )
        with ctx.publish_lock():
            path = store.publish(work, manifest)
            _write_index(store, sd.name, key, version)
        ctx.log.info("%s: published %s", sd.name, path)
        return path, True
    except PublishedElsewhere as done:
        ctx.log.info("%s: %s", sd.name, done)
        return done.path, False
    except BaseException as err:
        if isinstance(err, StageStopped):
            store.record_failure(sd.name, version, str(err), key=key, state="stopped")
        elif not isinstance(err, KeyboardInterrupt):
            store.record_failure(sd.name, version, f"{type(err).__name__}: {err}", key=key)
        raise


def _chain(sd: StageDef, by_name: dict[str, StageDef]) -> list[StageDef]:
    """`sd` and everything upstream of it, in pipeline order."""
    seen: list[StageDef] = []

    def visit(s: StageDef) -> None:
        for u in s.upstream:
            visit(by_name[u])
        if s not in seen:
            seen.append(s)

    visit(sd)
    return seen


__all__ = ["StageContext", "StageDef", "StageStatus", "StageFailed", "status", "run_stage", "fix_hint"]
