"""Operations config: deployments, scheduled retraining, the store lock, housekeeping, remote artifacts.

Nothing here changes what a stage builds, so no stage fingerprints it: editing `ops` never makes a stage stale.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from tuneline.schemas.base import StorageOptions, Strict

# Five cron fields, or one of the @-macros Prefect's scheduler understands.
_CRON = re.compile(r"^(@(yearly|annually|monthly|weekly|daily|hourly)|(\S+\s+){4}\S+)$")


class ScheduleConfig(Strict):
    cron: str | None = Field(
        None,
        description="cron expression for scheduled retraining on the pipeline deployment, "
        "e.g. '0 3 * * *'; null = no schedule",
    )
    timezone: str = Field("UTC", description="IANA time zone the cron expression is read in")
    active: bool = Field(True, description="false registers the schedule paused (resume it in the UI)")

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None and not _CRON.match(v.strip()):
            raise ValueError(
                f"{v!r} is not a cron expression: five fields 'minute hour day month weekday' "
                "(e.g. '0 3 * * *') or @daily/@hourly/@weekly/@monthly/@yearly"
            )
        return v.strip() if v else v


class OpsConfig(Strict):
    work_pool: str = Field(
        "tuneline",
        description="Prefect process work pool `tuneline deploy` registers on and "
        "`tuneline worker` serves (created when missing)",
    )
    gpu_pool: str | None = Field(
        None,
        description="work pool for the stages that use the accelerator (latents, "
        "text, train, validate) and the pipeline, e.g. a Kubernetes pool with GPU "
        "nodes; null = work_pool",
    )
    shard_pool: str | None = Field(
        None,
        description="work pool whose workers run the shards of a sharded latents or "
        "text stage (latents.shards / text.shards > 1), each a flow run of the "
        "`tuneline-shard` deployment on a machine sharing the workdir; null = local "
        "processes on this machine",
    )
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    train_concurrency: int = Field(
        1,
        ge=1,
        description="training stages running at once on this Prefect server "
        "(global concurrency limit `tuneline-train`, shared by every flow run)",
    )
    lock_timeout: float = Field(
        600.0,
        ge=0,
        description="seconds a stage waits while another process holds the "
        "artifact store's lock; then it refuses naming the holder. 0 = refuse at once",
    )
    keep_versions: int = Field(
        3,
        ge=0,
        description="`tuneline gc`: published versions kept per stage, newest "
        "first; fresh versions and what they were built from are always kept",
    )
    remote: str | None = Field(
        None, description="fsspec URL (e.g. s3://bucket/prefix) every published version is pushed to; null = local only"
    )
    remote_options: StorageOptions = Field(
        default_factory=dict,
        description="non-secret fsspec storage options, "
        "e.g. {endpoint_url: http://minio:9000}; credentials come from the "
        "environment (AWS_* variables, or TUNELINE_REMOTE_OPTIONS as JSON)",
    )
    report_url: str | None = Field(
        None,
        description="base URL where browsers reach <workdir>/artifacts (a static "
        "file server); set, validation images become Prefect image artifacts",
    )
