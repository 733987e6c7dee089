"""`tuneline lineage | gc | remote push|pull|ls | plan`: looking after published versions and planning memory
(registered in cli.py)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from tuneline.flows.cli_common import ConfigArg, WorkdirOpt, fail, load, print_rows, user_errors
from tuneline.schemas.families import SHIPPED_CONFIGS

remote_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=None, help="Artifact versions on object storage (ops.remote)."
)


def lineage(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON on stdout")] = False,
) -> None:
    """Every published version: stage, version, upstream versions, created, fresh for this config."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    cfg = load(config, workdir)
    from tuneline.flows.ops import lineage_rows

    try:
        rows = lineage_rows(cfg)
    except user_errors() as err:
        fail(str(err))
    print_rows(
        rows,
        as_json,
        ("stage", "version", "fresh", "upstream", "created_at"),
        lambda r: (
            r.stage,
            r.version,
            "fresh" if r.fresh else "",
            r.upstream_text(),
            r.created_at[:19].replace("T", " "),
        ),
    )


def gc(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    keep: Annotated[
        int | None, typer.Option("--keep", min=0, help="versions kept per stage; default ops.keep_versions")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only list what would go")] = False,
    partial: Annotated[
        bool, typer.Option("--partial", help="also delete interrupted work in progress (loses resumability)")
    ] = False,
) -> None:
    """Delete old versions: keep the newest K per stage and everything fresh or used by a fresh version."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    cfg = load(config, workdir)
    from tuneline.flows.ops import gc as collect

    try:
        p, freed = collect(cfg, cfg.ops.keep_versions if keep is None else keep, dry_run=dry_run, partial=partial)
    except user_errors() as err:
        fail(str(err))
    verb = "would remove" if dry_run else "removed"
    for path in p.remove:
        typer.echo(f"{verb} {path}")
    for path, why in p.keep.items():
        typer.echo(f"kept {path} ({why})")
    for path in p.partial:
        typer.echo(f"{verb if partial else 'left'} work in progress {path}")
    typer.echo(f"{verb} {len(p.remove)} versions" + ("" if dry_run else f", freed {freed / 1e6:.1f} MB"))


@remote_app.command("push")
def remote_push(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    stages: Annotated[list[str] | None, typer.Option("--stage", help="repeatable; default all")] = None,
) -> None:
    """Upload each stage's fresh version to ops.remote (versions already there are skipped)."""
    cfg = load(config, workdir)
    from tuneline.flows.ops import push

    try:
        for url in push(cfg, stages):
            typer.echo(f"pushed {url}")
    except user_errors() as err:
        fail(str(err))


@remote_app.command("pull")
def remote_pull(
    stage_name: Annotated[str, typer.Argument(metavar="STAGE")],
    version: str,
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
) -> None:
    """Download one version from ops.remote into the workdir, checking every file's checksum."""
    cfg = load(config, workdir)
    from tuneline.flows.ops import pull

    try:
        typer.echo(pull(cfg, stage_name, version))
    except user_errors() as err:
        fail(str(err))


@remote_app.command("ls")
def remote_ls(config: ConfigArg = None, workdir: WorkdirOpt = None) -> None:
    """Published versions on ops.remote: stage, version, URL (tab-separated)."""
    cfg = load(config, workdir)
    from tuneline.flows.ops import remote
    from tuneline.stages.pipeline import STAGE_NAMES

    try:
        r = remote(cfg)
        for s in STAGE_NAMES:
            for v in r.versions(s):
                typer.echo(f"{s}\t{v}\t{r.version_url(s, v)}")
    except user_errors() as err:
        fail(str(err))


def plan_memory(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    gpu_memory: Annotated[
        float | None, typer.Option("--gpu-memory", metavar="GIB", help="plan for a CUDA GPU with this much memory")
    ] = None,
    model_config: Annotated[
        str | None,
        typer.Option(
            "--model-config",
            metavar="NAME",
            help=f"plan a released model from its shipped weightless config ({', '.join(SHIPPED_CONFIGS)})",
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes", min=1, metavar="N", help="plan N training processes in all (FSDP shards over them)"
        ),
    ] = None,
) -> None:
    """Planned peak GPU memory per training process; exit 0 when it fits, 2 when not (with the settings that fit).

    With --model-config and no CONFIG it plans what a user of that model would run: LoRA, bf16, batch 1, the
    model's usual resolution; without either, the demo."""
    from tuneline.stages.train.planning import model_user_config, plan_command

    cfg = load(config, workdir)
    try:
        if config is None and model_config is not None:
            cfg = model_user_config(model_config, workdir)
        answer = plan_command(cfg, gpu_memory, model_config, processes)
    except user_errors() as err:
        fail(str(err))
    typer.echo(answer.text())
    raise typer.Exit(0 if answer.plan.fits else 2)
