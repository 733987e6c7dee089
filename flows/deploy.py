"""`tuneline deploy`: one deployment per stage plus the pipeline, on a work pool (a process pool by default).

Entrypoints are module paths (`tuneline.flows.stage_flows.train_flow`): the worker imports the installed tuneline,
so no code storage or image is needed for a process pool, and a container image with tuneline installed
serves a Kubernetes pool the same way. The config becomes every deployment's default `config` parameter
(a typed form in the UI), with its workdir made absolute because a worker runs flows in a temporary folder.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuneline.schemas.config import PipelineConfig

TAGS = ["tuneline"]


@dataclass
class Deployed:
    name: str  # flow/deployment, as `prefect deployment run` takes it
    pool: str
    schedule: str


def deployment_name(stage: str) -> str:
    return f"tuneline-{stage}"


def deployments(cfg: PipelineConfig, pool: str | None = None) -> list:
    """The RunnerDeployments for a config (nothing registered yet): the pipeline first, then each stage."""
    from prefect.types.entrypoint import EntrypointType

    from tuneline.flows.pipeline import pipeline_flow
    from tuneline.flows.stage_flows import STAGE_FLOWS

    cfg = cfg.model_copy(update={"workdir": str(cfg.workdir_path())})
    params = {"config": cfg.dump()}
    cpu_pool = pool or cfg.ops.work_pool
    gpu_pool = cfg.ops.gpu_pool or cpu_pool
    out = []
    # Every stage but scan (which only reads image headers) wants the accelerator, and so does the pipeline,
    # which runs every stage in its own process.
    from tuneline.stages.pipeline import stage_names

    on = stage_names(cfg)  # the caption stage only with caption.model set
    for name, fl in [("pipeline", pipeline_flow), *((n, f) for n, f in STAGE_FLOWS.items() if n in on)]:
        out.append(
            fl.to_deployment(
                name=deployment_name(name),
                parameters=params,
                work_pool_name=cpu_pool if name == "scan" else gpu_pool,
                tags=TAGS,
                schedules=_schedules(cfg) if name == "pipeline" else [],
                description=fl.description,
                entrypoint_type=EntrypointType.MODULE_PATH,
                concurrency_limit=cfg.ops.train_concurrency if name == "train" else None,
            )
        )
    from tuneline.flows.shards import DEPLOYMENT, shard_flow

    # Shards of a sharded latents/text stage, started by the stage (tuneline.flows.shards): no parameters to fill.
    out.append(
        shard_flow.to_deployment(
            name=DEPLOYMENT,
            work_pool_name=cfg.ops.shard_pool or gpu_pool,
            tags=TAGS,
            description=shard_flow.description,
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
    )
    return out


def deploy(cfg: PipelineConfig, pool: str | None = None) -> list[Deployed]:
    """Register (create or update) the deployments, creating missing pools and the training limit."""
    from tuneline.flows.limits import ensure_train_limit

    ensure_train_limit(cfg.ops.train_concurrency, update=True)
    out = []
    for d in deployments(cfg, pool):
        ensure_pool(d.work_pool_name)
        d.apply()
        crons = [s.schedule.cron for s in d.schedules or []]
        out.append(Deployed(f"{d.flow_name}/{d.name}", d.work_pool_name, ", ".join(crons)))
    return out


def _schedules(cfg: PipelineConfig) -> list:
    from prefect.schedules import Cron

    s = cfg.ops.schedule
    # An empty list (not None) clears a schedule an earlier deploy registered.
    return [Cron(s.cron, timezone=s.timezone, active=s.active)] if s.cron else []


def ensure_pool(name: str) -> None:
    """Create a process work pool when none has this name; an existing pool (any type) is used as is."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            template = ProcessWorker.get_default_base_job_template()
            try:
                client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            except ObjectAlreadyExists:
                pass
