"""What every `tuneline` command shares: the CONFIG/--workdir arguments, loading the config, and one clear
error line for what a user can fix (exit 1), whose fix commands repeat the CONFIG and --workdir as typed."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from tuneline.schemas.config import ConfigError, PipelineConfig, load_config

# metavar without brackets: click adds them for an optional argument (usage read `[[CONFIG]]`).
ConfigArg = Annotated[Path | None, typer.Argument(metavar="CONFIG", help="YAML config; omitted = the built-in demo")]
WorkdirOpt = Annotated[str | None, typer.Option("--workdir", metavar="DIR", help="overrides the config's workdir")]


# The CONFIG and --workdir this command was given, as typed: fix commands in messages repeat them.
_invocation: dict[str, str | None] = {"config": None, "workdir": None}
FIX_COMMAND = re.compile(r"`tuneline (run|stage [a-z]+)((?: --[a-z-]+(?: [a-z]+)?)*)`")


def with_invocation(msg: str, config: str | None, workdir: str | None) -> str:
    """Make every `tuneline run|stage …` a message names runnable as printed from this directory: it gets the
    CONFIG and --workdir of the command that failed (docs/design.md)."""

    def complete(m: re.Match) -> str:
        args = [m.group(1)] + ([shlex.quote(config)] if config else []) + ([m.group(2).strip()] if m.group(2) else [])
        args += [f"--workdir {shlex.quote(workdir)}"] if workdir else []
        return "`tuneline " + " ".join(args) + "`"

    return FIX_COMMAND.sub(complete, msg)


def fail(msg: str, code: int = 1) -> None:
    """One error line, then exit `code`: 1, or a training's own (3 stopped, 4 out of memory, 5 a rank lost or a
    CUDA error: docs/stopping.md)."""
    typer.echo(f"error: {with_invocation(msg, _invocation['config'], _invocation['workdir'])}", err=True)
    raise typer.Exit(code)


def load(config: Path | None, workdir: str | None) -> PipelineConfig:
    _invocation.update(config=None if config is None else str(config), workdir=workdir)
    try:
        cfg = load_config(config, workdir)
    except ConfigError as err:
        fail(str(err))
        raise  # unreachable
    from tuneline.flows.preflight import workdir_not_a_folder

    problem = workdir_not_a_folder(cfg)
    if problem:
        fail(problem)
    return cfg


def store_errors() -> tuple[type[BaseException], ...]:
    """The user errors of reading the config and the artifact store, without importing the training launcher
    (and with it torch: seconds of a run that finds nothing to do)."""
    from tuneline.flows.preflight import Refused
    from tuneline.stages.common.artifacts import ArtifactError
    from tuneline.stages.common.lock import StoreLocked
    from tuneline.stages.common.remote import RemoteError
    from tuneline.stages.common.stage import StageFailed

    return (Refused, ConfigError, ArtifactError, StageFailed, StoreLocked, RemoteError, FileNotFoundError, ValueError)


def user_errors() -> tuple[type[BaseException], ...]:
    from tuneline.stages.train.failures import TrainingFailed

    return (*store_errors(), TrainingFailed)


def print_rows(rows: list, as_json: bool, header: tuple[str, ...], cells) -> None:
    """Rows as JSON on stdout (each row's `as_json()`), or as a table of `cells(row)` under `header`."""
    if as_json:
        sys.stdout.write(json.dumps([r.as_json() for r in rows], indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(*header)
    for r in rows:
        table.add_row(*map(str, cells(r)))
    Console().print(table)
