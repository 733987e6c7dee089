"""The `tuneline` command line (docs/design.md). Errors a user can fix print one clear message and exit 1."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Annotated

import typer

import tuneline.flows  # noqa: F401  (sets Prefect logging env before prefect is imported)
from tuneline.flows import cli_ops
from tuneline.flows.captions_cli import captions_app
from tuneline.flows.cli_common import ConfigArg, WorkdirOpt, fail, load, print_rows, store_errors, user_errors
from tuneline.schemas.config import ConfigError, PipelineConfig, example_yaml

# Plain help (rich_markup_mode=None): typer's rich help prints a `<bool>` value placeholder after every flag
# (`--force <bool>`), which reads as if the flag took a value.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None)
config_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Example config and JSON schema.")
app.add_typer(config_app, name="config")
app.add_typer(cli_ops.remote_app, name="remote")
app.add_typer(captions_app, name="captions")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"tuneline {version('tuneline')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """Diffusion fine-tuning as Prefect flows: scan -> latents -> text -> train -> validate, each stage a versioned
    artifact. Without CONFIG, commands use the built-in demo; docs: docs/index.md."""


@app.command()
def run(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild every stage")] = False,
    until: Annotated[
        str | None,
        typer.Option("--until", metavar="STAGE", help="build every stage up to and including STAGE, then stop"),
    ] = None,
) -> None:
    """Run the whole pipeline (or up to --until); stages already fresh are skipped."""
    from tuneline.flows import preflight
    from tuneline.stages.pipeline import STAGE_NAMES, stage_names

    if until is not None and until not in STAGE_NAMES:
        fail(f"unknown stage {until!r} for --until; stages are: {', '.join(STAGE_NAMES)}")
    cfg = load(config, workdir)
    _refuse(lambda: preflight.check_paths(cfg))
    every = stage_names(cfg)
    if until is not None and until not in every:
        fail(f"--until {until}: the {until} stage is off in this config (it runs: {', '.join(every)})")
    names = every[: every.index(until) + 1] if until else every
    runs = None if force else _nothing_to_run(cfg, names)
    if runs is None:

        def call():
            from tuneline.flows.pipeline import pipeline_flow

            return pipeline_flow(config=cfg, force=force, until=until)

        runs = _in_flows(cfg, call)
    from tuneline.flows.summary import summary_lines

    typer.echo(f"artifacts: {cfg.workdir_path() / 'artifacts'}")
    if "validate" in runs:
        typer.echo(f"validation images: {runs['validate']['path']}")
    typer.echo("\n".join(summary_lines(runs)))


def _refuse(check) -> None:
    """Run a refusal check (tuneline.flows.preflight) before anything starts; its message is the error. Not
    `user_errors()`: that imports the training launcher, and with it torch (seconds on this path)."""
    from tuneline.flows.preflight import Refused
    from tuneline.stages.common.artifacts import ArtifactError

    try:
        check()
    except (Refused, ConfigError, ArtifactError, FileNotFoundError, ValueError) as err:
        fail(str(err))


def _in_flows(cfg: PipelineConfig, call):
    """Call a flow with an API server for it (the configured one, or a temporary one started here) and a console
    that shows each message once; user errors and Ctrl-C end in one line."""
    from tuneline.flows import preflight
    from tuneline.flows.server import ServerUnavailable, api_for_flows

    try:
        url = api_for_flows()
    except ServerUnavailable as err:
        fail(str(err))
        raise  # unreachable
    from contextlib import nullcontext

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tuneline.flows.console import quiet_console

    quiet_console(user_errors(), url)
    preflight.checked_in_this_process = True  # the flows need not repeat what was just checked
    started = time.time()
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}) if url else nullcontext():
            return call()
    except user_errors() as err:
        fail(str(err), getattr(err, "exit_code", 1))
    except Exception as err:
        _fail_if_unauthorized(err)
        raise
    except KeyboardInterrupt:
        from tuneline.flows.runs import workers_message

        why = workers_message(cfg, started) or "a training keeps its last checkpoint for the next run"
        typer.echo(f"error: interrupted (Ctrl-C); the flow runs are marked crashed; {why}", err=True)
        raise typer.Exit(130) from None


def _fail_if_unauthorized(err: BaseException) -> None:
    from tuneline.flows.runs import unauthorized_message

    msg = unauthorized_message(err)
    if msg:
        fail(msg)


def _nothing_to_run(cfg: PipelineConfig, names: list[str]) -> dict[str, dict] | None:
    from tuneline.flows.runs import fresh_summary

    try:
        runs = fresh_summary(cfg, names, store_errors())
    except store_errors() as err:
        fail(str(err))
        raise  # unreachable
    if runs is not None:
        typer.echo("every stage is fresh: nothing to build")
    return runs


@app.command()
def stage(
    name: Annotated[
        str,
        typer.Argument(
            metavar="NAME", help="scan | caption (with caption.model set) | latents | text | train | validate"
        ),
    ],
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild even if fresh")] = False,
) -> None:
    """Run one stage as its own flow run (its upstream artifacts must be fresh)."""
    from tuneline.stages.pipeline import STAGE_NAMES

    if name not in STAGE_NAMES:
        fail(f"unknown stage {name!r}; stages are: {', '.join(STAGE_NAMES)}")
    cfg = load(config, workdir)
    from tuneline.flows import preflight
    from tuneline.stages.pipeline import stage_names

    if name not in stage_names(cfg):  # refused before any Prefect server starts
        fail(
            f"stage {name} is off in this config: set {name}.model (a local vision-language model folder, or "
            f"tiny) to run it"
        )

    _refuse(lambda: preflight.check_stage(cfg, name))

    def call():
        from tuneline.flows.stage_flows import STAGE_FLOWS

        return STAGE_FLOWS[name](config=cfg, force=force)

    typer.echo(_in_flows(cfg, call))


@app.command()
def status(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON on stdout, logs on stderr")] = False,
) -> None:
    """Per stage: fresh / stale / missing / failed / stopped, version, path, reason."""
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    cfg = load(config, workdir)
    from tuneline.stages.common.stage import StageContext, status as stage_status
    from tuneline.stages.pipeline import PIPELINE

    try:
        rows = stage_status(StageContext(cfg), PIPELINE, reuse=True)
    except user_errors() as err:
        fail(str(err))
    print_rows(
        rows,
        as_json,
        ("stage", "state", "version", "path", "summary", "reason"),
        lambda r: (r.stage, r.state, r.version or "-", r.path or "-", r.summary, r.reason),
    )


@config_app.command("example")
def config_example(
    minimal: Annotated[
        bool, typer.Option("--minimal", help="only the keys a run on your own images needs; the rest default")
    ] = False,
) -> None:
    """Print a complete YAML config equivalent to the demo, each key commented with what it does."""
    from tuneline.schemas.demo import MINIMAL_YAML
    from tuneline.schemas.reference import commented_yaml

    sys.stdout.write(MINIMAL_YAML if minimal else commented_yaml(example_yaml()))


@config_app.command("schema")
def config_schema() -> None:
    """Print the config's JSON schema."""
    sys.stdout.write(json.dumps(PipelineConfig.model_json_schema(by_alias=True), indent=2) + "\n")


@app.command()
def deploy(
    config: ConfigArg = None,
    workdir: WorkdirOpt = None,
    pool: Annotated[str | None, typer.Option("--pool", help="work pool; default ops.work_pool")] = None,
) -> None:
    """Register one Prefect deployment per stage plus the pipeline (CONFIG = their default parameters)."""
    cfg = load(config, workdir)
    from prefect.settings import PREFECT_API_URL

    from tuneline.flows.deploy import deploy as register

    if not PREFECT_API_URL.value():
        typer.echo(
            "warning: PREFECT_API_URL is not set, so the deployments go to the local ephemeral database, "
            "which no UI shows; start `prefect server start` and set PREFECT_API_URL",
            err=True,
        )
    try:
        deployed = register(cfg, pool)
    except user_errors() as err:
        fail(str(err))
    except Exception as err:
        _fail_if_unauthorized(err)
        raise
    for d in deployed:
        typer.echo(f"{d.name}  pool {d.pool}" + (f"  schedule {d.schedule}" if d.schedule else ""))
    pools = sorted({d.pool for d in deployed})
    typer.echo(f"start a worker: {'; '.join(f'tuneline worker --pool {p}' for p in pools)}", err=True)


@app.command()
def worker(
    pool: Annotated[str, typer.Option("--pool", help="work pool to serve")] = "tuneline",
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="flow runs at once")] = None,
) -> None:
    """Start a Prefect process worker for the pool (created if missing); restarted if it crashes."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s | %(levelname)s | %(message)s")
    from tuneline.flows.worker import serve

    raise typer.Exit(serve(pool, limit))


# Registered here, after the pipeline's own commands, so `tuneline --help` lists them in this order.
app.command()(cli_ops.lineage)
app.command()(cli_ops.gc)
app.command("plan")(cli_ops.plan_memory)


def _whole_short_help(t: typer.Typer) -> None:
    """Command lists show each command's first sentence whole: click otherwise cuts it to what fits beside the
    name in 80 columns, ending in "..." (wrapping a long one is better than cutting it)."""
    for info in t.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None) or ""
        info.short_help = info.short_help or " ".join(doc.split("\n\n")[0].split())
    for group in t.registered_groups:
        if group.typer_instance is not None:
            _whole_short_help(group.typer_instance)


_whole_short_help(app)


def main() -> None:
    from gc import freeze  # `gc` here is the command of that name

    try:
        app()
    finally:
        # The command is done. Python's exit ends with a garbage collection over every object alive, which costs a
        # process that imported torch ~0.35 s of its ~0.45 s exit on 2 cores (bench/incremental.py); frozen objects
        # are skipped. Exit handlers (Prefect's log flush) and module teardown still run.
        freeze()


if __name__ == "__main__":
    main()
