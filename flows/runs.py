"""What `tuneline run` decides before (or instead of) starting Prefect, and how a Prefect HTTP refusal reads."""

from __future__ import annotations

from tuneline.schemas.config import PipelineConfig


def fresh_summary(
    cfg: PipelineConfig, names: list[str], user_errors: tuple[type[BaseException], ...]
) -> dict[str, dict] | None:
    """Every stage fresh and no Prefect server to record a flow run on: the stages' summary without starting
    Prefect (its temporary server is most of a no-op run's time). None = run the pipeline flow."""
    from tuneline.flows.server import server_configured

    if cfg.ops.remote or server_configured():
        return None  # a server shows every run, even a no-op one; a remote may still need its push
    if cfg.dataset.demo:
        from tuneline.stages.common.lock import store_lock
        from tuneline.stages.scan.demo import write_demo_for

        # Under the store's lock, as the scan flow writes it: two runs of one fresh demo workdir otherwise both
        # generated the dataset at once and the slower one crashed (`Directory not empty`).
        with store_lock(cfg.workdir_path(), timeout=cfg.ops.lock_timeout, purpose="demo dataset"):
            write_demo_for(cfg)  # a no-op when current
    from tuneline.stages.common.stage import StageContext, status as stage_status
    from tuneline.stages.pipeline import stage as stage_def

    try:
        rows = stage_status(StageContext(cfg), [stage_def(n) for n in names])
    except user_errors:
        return None  # the flow reports it properly
    if any(r.state != "fresh" for r in rows):
        return None
    return {r.stage: {"path": r.path, "seconds": 0.0, "built": False} for r in rows}


def unauthorized_message(err: BaseException) -> str | None:
    """A 401 from the Prefect server (its PREFECT_SERVER_API_AUTH_STRING is set, ours is not or differs) as one
    line naming the setting, instead of Prefect's HTTP traceback; None for any other error."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if getattr(response, "status_code", None) == 401:
            from prefect.settings import PREFECT_API_URL

            return (
                f"the Prefect server at {PREFECT_API_URL.value() or '(temporary server)'} answered 401 "
                "Unauthorized: it requires basic auth; set PREFECT_API_AUTH_STRING=user:password to the "
                "server's PREFECT_SERVER_API_AUTH_STRING (docs/operations.md: Prefect authentication)"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def workers_message(cfg: PipelineConfig, since: float) -> str | None:
    """What the training workers said when they stopped (rank 0's error.json in the train work folder: the step
    and the checkpoint kept), when they wrote it after `since`; None otherwise."""
    import json

    from tuneline.stages.train.failcause import ERROR

    found = []
    for f in (cfg.workdir_path() / "artifacts" / "train").glob(f".*/{ERROR}"):
        try:
            if f.stat().st_mtime >= since:
                found.append((f.stat().st_mtime, json.loads(f.read_text(encoding="utf-8"))["error"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(found)[1] if found else None
