"""The `tuneline` command line (CONTRACT.md). Errors a user can fix print one clear message and exit 1."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

import flows  # noqa: F401  (sets Prefect logging env before prefect is imported)
from schemas.config import ConfigError, PipelineConfig, example_yaml, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Diffusion fine-tuning as Prefect flows.")
config_app = typer.Typer(no_args_is_help=True, help="Example config and JSON schema.")
app.add_typer(config_app, name="config")

ConfigArg = Annotated[Optional[Path], typer.Argument(help="YAML config; omitted = the built-in demo")]
WorkdirOpt = Annotated[Optional[str], typer.Option("--workdir", help="overrides the config's workdir")]


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(1)


def _load(config: Path | None, workdir: str | None) -> PipelineConfig:
    try:
        return load_config(config, workdir)
    except ConfigError as err:
        _fail(str(err))
        raise  # unreachable


def _user_errors() -> tuple[type[BaseException], ...]:
    from stages.common.artifacts import ArtifactError
    from stages.common.stage import StageFailed
    from stages.train.launch import TrainingFailed

    return (ConfigError, ArtifactError, StageFailed, TrainingFailed, FileNotFoundError, ValueError)


@app.command()
def run(config: ConfigArg = None, workdir: WorkdirOpt = None,
        force: Annotated[bool, typer.Option("--force", help="rebuild every stage")] = False) -> None:
    """Run the whole pipeline; stages already fresh are skipped."""
    cfg = _load(config, workdir)
    from flows.pipeline import pipeline_flow

    try:
        paths = pipeline_flow(config=cfg, force=force)
    except _user_errors() as err:
        _fail(str(err))
    typer.echo(f"artifacts: {cfg.workdir_path() / 'artifacts'}")
    typer.echo(f"validation images: {paths['validate']}")


@app.command()
def stage(name: Annotated[str, typer.Argument(help="scan | latents | text | train | validate")],
          config: ConfigArg = None, workdir: WorkdirOpt = None,
          force: Annotated[bool, typer.Option("--force", help="rebuild even if fresh")] = False) -> None:
    """Run one stage as its own flow run (its upstream artifacts must be fresh)."""
    from stages.pipeline import STAGE_NAMES

    if name not in STAGE_NAMES:
        _fail(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}")
    cfg = _load(config, workdir)
    from flows.stage_flows import STAGE_FLOWS

    try:
        path = STAGE_FLOWS[name](config=cfg, force=force)
    except _user_errors() as err:
        _fail(str(err))
    typer.echo(path)


@app.command()
def status(config: ConfigArg = None, workdir: WorkdirOpt = None,
           as_json: Annotated[bool, typer.Option("--json", help="JSON on stdout, logs on stderr")] = False) -> None:
    """Per stage: fresh / stale / missing / failed, version, path, reason."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    cfg = _load(config, workdir)
    from stages.common.stage import StageContext, status as stage_status
    from stages.pipeline import PIPELINE

    try:
        rows = stage_status(StageContext(cfg), PIPELINE)
    except _user_errors() as err:
        _fail(str(err))
    if as_json:
        sys.stdout.write(json.dumps([r.as_json() for r in rows], indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("stage", "state", "version", "summary", "reason")
    for r in rows:
        table.add_row(r.stage, r.state, r.version or "-", r.summary, r.reason)
    Console().print(table)


@config_app.command("example")
def config_example() -> None:
    """Print a complete YAML config equivalent to the demo."""
    sys.stdout.write(example_yaml())


@config_app.command("schema")
def config_schema() -> None:
    """Print the config's JSON schema."""
    sys.stdout.write(json.dumps(PipelineConfig.model_json_schema(by_alias=True), indent=2) + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
