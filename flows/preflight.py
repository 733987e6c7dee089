"""Refusals decided before any Prefect server or flow run starts: paths that must exist, a workdir that can be
written, and for one stage every upstream stage (direct or through another) that is not fresh, named together.

Importing prefect, torch or diffusers costs seconds here, so nothing on this path imports them: a refused
config answers in about the time `tuneline status` takes and writes nothing. A run started from a deployment
makes the same checks at the start of its flow (tuneline.flows.stage_flows), so the message is the same.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

from tuneline.schemas.base import ConfigPath, is_url
from tuneline.schemas.config import PipelineConfig

# Set by the CLI once it has made these checks, and by the pipeline flow around its stages (each stage's upstreams
# run before it there): a stage flow then does not repeat them.
checked_in_this_process = False
in_pipeline = False


class Refused(Exception):
    """A run or stage that cannot start; the message names what is at fault and the command that fixes it."""


def missing_paths(cfg: PipelineConfig) -> list[str]:
    """`field: path` of every path in the config that must exist and does not (the demo writes its own dataset).
    Checked here, not by a config validator: `status`, `deploy` and `config` must accept a config whose data lives
    on another machine (a worker's)."""
    out: list[str] = []
    for field, value in _config_paths(cfg, cfg, ""):
        if (
            (field == "dataset.path" and cfg.dataset.demo)
            or (field == "dataset.control" and cfg.dataset.demo == "edit")
            or is_url(value)
        ):  # object storage: the scan names a missing prefix with its own fix
            continue
        # normpath: `../photos` beside a workdir not created yet exists, though `tuneline-work/../photos` does not
        # resolve while `tuneline-work` is missing (the workdir itself is already resolved, so no link is skipped).
        path = os.path.normpath(cfg.resolve(value))
        if not os.path.lexists(path):
            out.append(f"{field}: {path}")
    return out


def _config_paths(cfg: PipelineConfig, model: BaseModel, prefix: str) -> list[tuple[str, str]]:
    """(dotted field, value) of every field marked ConfigPath that holds a path (not a keyword such as `alpha`)."""
    out: list[tuple[str, str]] = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        field = f"{prefix}{info.alias or name}"
        marker = next((m for m in info.metadata if isinstance(m, ConfigPath)), None)
        if marker is not None:
            if isinstance(value, str) and value not in marker.keywords and field != "workdir":
                out.append((field, value))
        elif isinstance(value, BaseModel):
            out += _config_paths(cfg, value, field + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    out += _config_paths(cfg, item, f"{field}[{i}].")
    return out


def workdir_not_a_folder(cfg: PipelineConfig) -> str | None:
    """Every command that reads the store refuses a workdir that is a file (it crashed with NotADirectoryError)."""
    workdir = cfg.workdir_path()
    if os.path.lexists(workdir) and not workdir.is_dir():
        return f"workdir {workdir} is a file, not a folder: pass another --workdir or move the file away"
    return None


def workdir_problem(cfg: PipelineConfig) -> str | None:
    """Why the workdir cannot hold artifacts (a file, or a folder this user cannot write), or None."""
    workdir = cfg.workdir_path()
    existing = next((p for p in (workdir, *workdir.parents) if os.path.lexists(p)), None)
    if existing is None:
        return None
    if existing == workdir and not workdir.is_dir():
        return workdir_not_a_folder(cfg)
    if existing != workdir and not existing.is_dir():
        return f"workdir {workdir} cannot be created: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "workdir" if existing == workdir else f"workdir {workdir} cannot be created: its parent"
        return f"{what} {existing} is not writable by this user: pass a --workdir you can write to"
    return None


def check_paths(cfg: PipelineConfig) -> None:
    """Refuse a config whose workdir cannot be written or whose inputs do not exist (run and every stage)."""
    problem = workdir_problem(cfg)
    if problem:
        raise Refused(problem)
    missing = missing_paths(cfg)
    if missing:
        raise Refused(
            "the config names paths that do not exist: "
            + "; ".join(missing)
            + ": fix them in the config (or copy the files there)"
            + relative_rule(cfg, missing)
        )


def relative_rule(cfg: PipelineConfig, missing: list[str]) -> str:
    """Why a path that lies in the workdir was looked for there: relative paths in a config resolve against the
    workdir (so every process of a run, wherever it starts, reads the same files), not against the directory the
    command runs in, which is where users tend to look. Names the folder it would have meant, when that exists."""
    workdir = cfg.workdir_path()
    inside = [m.split(": ", 1) for m in missing if Path(m.split(": ", 1)[1]).is_relative_to(workdir)]
    if not inside:
        return ""
    field, path = inside[0]
    rel = Path(path).relative_to(workdir)
    here = Path.cwd() / rel
    hint = f"; {here} exists: write {field}: {here} (or {os.path.relpath(here, workdir)})" if here.exists() else ""
    return (
        f". A relative path in a config is resolved against the workdir ({workdir}), not the directory tuneline "
        f"runs in, so that every process of a run reads the same files: {field}: {rel} was looked for as "
        f"{path}{hint}"
    )


def upstream_chain(name: str, cfg: PipelineConfig | None = None) -> list[str]:
    """Every stage `name` depends on, directly or through another, in pipeline order (with `cfg`, the optional
    stages it turns on, such as caption, count too)."""
    from tuneline.stages.common.stage import active
    from tuneline.stages.pipeline import PIPELINE

    stages = active(cfg, PIPELINE) if cfg is not None else PIPELINE
    by_name = {s.name: s for s in stages}
    needed: set[str] = set()
    todo = list(by_name[name].upstream)
    while todo:
        u = todo.pop()
        if u not in needed:
            needed.add(u)
            todo += by_name[u].upstream
    return [s.name for s in stages if s.name in needed]


def upstream_refusal(cfg: PipelineConfig, name: str) -> str | None:
    """One message naming every upstream stage of `name` that is missing, stale or failing its checks, with one
    fix: `tuneline stage X` when exactly one is at fault, else `tuneline run --until NAME`. None = all fresh."""
    chain = upstream_chain(name, cfg)
    if not chain:
        return None
    from tuneline.stages.common.stage import StageContext, status
    from tuneline.stages.pipeline import stage

    rows = status(StageContext(cfg), [stage(s) for s in chain])
    bad = [r for r in rows if r.state != "fresh"]
    if not bad:
        return None
    what = "; ".join(f"the {r.stage} artifact is {r.state} ({r.reason})" for r in bad)
    fix = f"tuneline stage {bad[0].stage}" if len(bad) == 1 else f"tuneline run --until {name}"
    return f"stage {name} needs its upstream stages fresh: {what}; run `{fix}` first"


def check_stage(cfg: PipelineConfig, name: str) -> None:
    check_paths(cfg)
    msg = upstream_refusal(cfg, name)
    if msg:
        raise Refused(msg)
