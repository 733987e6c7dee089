"""`tuneline captions export|show`: the caption stage's artifact for people to review (registered in cli.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

captions_app = typer.Typer(no_args_is_help=True, help="Captions from the caption stage: export, show.")

ConfigArg = Annotated[Path, typer.Argument(help="YAML config with caption.model set")]
WorkdirOpt = Annotated[str | None, typer.Option("--workdir", help="overrides the config's workdir")]


@captions_app.command("export")
def captions_export(config: ConfigArg, workdir: WorkdirOpt = None,
                    to: Annotated[Path | None, typer.Option("--to", help="folder to write the .txt sidecars to; "
                                                            "default <workdir>/captions/<version>")] = None) -> None:
    """Write the captions as .txt sidecars (without the trigger) for review and editing."""
    from tuneline.flows import cli
    from tuneline.stages.caption.export import export

    cfg = cli._load(config, workdir)
    try:
        out, n = export(cfg, to)
    except cli._user_errors() as err:
        cli._fail(str(err))
    typer.echo(f"wrote {n} caption files to {out}")


@captions_app.command("show")
def captions_show(config: ConfigArg, workdir: WorkdirOpt = None,
                  count: Annotated[int, typer.Option("--count", min=1, help="captions printed")] = 8) -> None:
    """Print a sample of the captions (model captions first)."""
    from tuneline.flows import cli
    from tuneline.stages.caption.export import fresh_caption_dir, show_lines

    cfg = cli._load(config, workdir)
    try:
        lines = show_lines(fresh_caption_dir(cfg), count)
    except cli._user_errors() as err:
        cli._fail(str(err))
    typer.echo("\n".join(lines))
