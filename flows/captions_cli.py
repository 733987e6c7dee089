"""`tuneline captions export|show`: the caption stage's artifact for people to review (registered in cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuneline.stages.common.artifacts import ArtifactError


def fresh_caption_dir(cfg) -> Path:
    """The caption artifact the current config and dataset map to, or a refusal naming the fix."""
    from tuneline.stages.common.stage import StageContext, status
    from tuneline.stages.pipeline import PIPELINE

    if not cfg.caption.enabled:
        raise ArtifactError(
            "caption.model is not set, so there is no caption stage: set caption.model to a "
            "local vision-language model folder (or tiny) and run `tuneline stage caption`"
        )
    row = next(r for r in status(StageContext(cfg), PIPELINE) if r.stage == "caption")
    if row.state != "fresh" or row.path is None:
        raise ArtifactError(f"the caption artifact is {row.state} ({row.reason}); run `tuneline stage caption` first")
    return Path(row.path)


captions_app = typer.Typer(no_args_is_help=True, help="Captions from the caption stage: export, show.")

ConfigArg = Annotated[Path, typer.Argument(help="YAML config with caption.model set")]
WorkdirOpt = Annotated[str | None, typer.Option("--workdir", help="overrides the config's workdir")]


@captions_app.command("export")
def captions_export(
    config: ConfigArg,
    workdir: WorkdirOpt = None,
    to: Annotated[
        Path | None,
        typer.Option("--to", help="folder to write the .txt sidecars to; default <workdir>/captions/<version>"),
    ] = None,
) -> None:
    """Write the captions as .txt sidecars (without the trigger) for review and editing."""
    from tuneline.flows import cli_common
    from tuneline.stages.caption.export import export

    cfg = cli_common.load(config, workdir)
    try:
        out, n = export(cfg, fresh_caption_dir(cfg), to)
    except cli_common.user_errors() as err:
        cli_common.fail(str(err))
    typer.echo(f"wrote {n} caption files to {out}")


@captions_app.command("show")
def captions_show(
    config: ConfigArg,
    workdir: WorkdirOpt = None,
    count: Annotated[int, typer.Option("--count", min=1, help="captions printed")] = 8,
) -> None:
    """Print a sample of the captions (model captions first)."""
    from tuneline.flows import cli_common
    from tuneline.stages.caption.export import show_lines

    cfg = cli_common.load(config, workdir)
    try:
        lines = show_lines(fresh_caption_dir(cfg), count)
    except cli_common.user_errors() as err:
        cli_common.fail(str(err))
    typer.echo("\n".join(lines))
