"""The train stage's build: the launch's spec (resume target, initial model), the memory check, the training
processes (stages/train/workers.py), then the result, its loss curve and, with several nodes, the wait for the
node that publishes."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from tuneline.schemas.train_manifest import TrainManifest
from tuneline.stages.common.gc import stale_launch_files
from tuneline.stages.common.jsonl import read_jsonl
from tuneline.stages.common.lock import IN_USE, in_use
from tuneline.stages.common.stage import PublishedElsewhere
from tuneline.stages.families import resolve as models
from tuneline.stages.render.plots import loss_curve
from tuneline.stages.train import checkpoint as ckpt, collectives, fsdpload, init_source
from tuneline.stages.train.checkpoint import CHECKPOINTS
from tuneline.stages.train.failcause import ERROR, LOSSES, RESULT
from tuneline.stages.train.failures import TrainingFailed
from tuneline.stages.train.memcheck import check_before_training
from tuneline.stages.train.stopping import STOP_GRACE_S
from tuneline.stages.train.workers import run_workers, runs_alone, worker_command

FOLLOW_TIMEOUT_S = 600  # how long a node without global rank 0 waits for that node to publish


def resume_target(ctx, work: Path) -> Path | None:
    """Resolve train.resume before any process starts (a missing target is an error, never a fresh start).
    A fresh start clears the checkpoints an earlier attempt of this same run left behind, so "keep the last K"
    and "latest" only ever see this attempt's."""
    root = work / CHECKPOINTS
    try:
        target = ckpt.resolve(ctx.cfg.train.resume, root, ctx.workdir)
        if target is not None and ctx.cfg.train.resume not in ("auto", "latest"):  # those are this run's own
            ckpt.check_made_with(ctx.cfg, target)
    except ckpt.CheckpointError as err:
        raise TrainingFailed(str(err)) from None
    if target is None:
        n = ckpt.clear(root)
        if n:
            ctx.log.warning(
                "train: starting from the base model (train.resume is null); removed %d checkpoint(s) "
                "of an interrupted earlier attempt; set train.resume: latest to continue one instead",
                n,
            )
    return target


def previous_model(ctx, upstream: dict) -> tuple[Path, str | None]:
    """The pipeline folder training starts from: the base model, or with train.init_from previous the train
    version the key names (tuneline.stages.train.init_source)."""
    if ctx.cfg.train.init_from != "previous":
        return models.model_dir(ctx), None
    source = init_source(ctx.store, {name: m.fingerprint for name, m in upstream.items()})
    if source is None:
        ctx.log.info("train: init_from previous, but no earlier full fine-tune exists; starting from the base model")
        return models.model_dir(ctx), None
    m = ctx.store.read(source, TrainManifest)
    ctx.log.info("train: starting from the weights of train version %s", m.fingerprint)
    return source / m.final, m.fingerprint


def write_spec(ctx, work: Path, upstream: dict, resume: Path | None, model_dir: Path, token: str) -> Path:
    """Everything a worker needs, by path: each rank re-reads and re-verifies the same manifests."""
    spec = {
        "config": ctx.cfg.dump(),
        "model_dir": str(model_dir),
        "out_dir": str(work),
        "upstream": {name: str(models.artifact_dir(ctx, m)) for name, m in upstream.items()},
        "resume": str(resume) if resume else None,
        "launch": token,
        "seen": str(beside(work, "seen", token)),
        "stop": str(beside(work, "stop", token)),  # the launcher's mark: this SIGTERM is a stop (stopping.py)
        # For the LoRA files' metadata: this run's version (the directory it is published under) and the base.
        "export": {
            "train_version": work.name.removeprefix(".").removesuffix(".partial"),
            "base_identity": models.identity(ctx, "denoiser"),
        },
    }
    path = beside(work, "spec", token)
    path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return path


def beside(work: Path, kind: str, token: str) -> Path:
    """A launch's own file beside the work folder, not in it: nodes sharing the folder each write one, and the
    publishing node must not list another node's file in the published version."""
    return work.parent / f"{work.name}.{kind}-{token}.json"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def gpu_problem(processes: int, device: str, gpus: int) -> str | None:
    """Why `processes` ranks cannot each have a GPU on this node (NCCL refuses two ranks on one GPU), or None.
    Under the gloo test switch (tuneline.stages.train.collectives) ranks may share a GPU."""
    if device != "cuda" or processes <= gpus or (gpus and collectives.shares_gpus()):
        return None
    return (
        f"train.processes is {processes} but this node has {gpus} visible GPU(s), and each DDP process needs a "
        f"GPU of its own: set train.processes: {gpus} (one per GPU; raise train.grad_accumulation to keep the "
        f"global batch), or model.device: cpu to train with {processes} CPU processes"
    )


def build(ctx, work: Path, upstream: dict) -> dict:
    dev = models.device(ctx.cfg)
    problem = gpu_problem(ctx.cfg.train.processes, dev.type, gpu_count() if dev.type == "cuda" else 0)
    if problem:
        raise ValueError(problem)
    token = uuid.uuid4().hex  # names this launch: global rank 0 writes it into the result
    # Left by an earlier attempt (another node of this attempt cannot have written yet: no rank runs before every
    # node has joined the rendezvous).
    for f in [work / RESULT, work / ERROR, *work.glob("error-rank*.json")]:
        f.unlink(missing_ok=True)
    if ctx.cfg.train.nodes == 1:  # alone on this folder: files of killed launches before it are stale
        for f in stale_launch_files(work.parent):
            f.unlink(missing_ok=True)
    resume = resume_target(ctx, work)
    model_dir, initialized_from = previous_model(ctx, upstream)
    if ctx.cfg.train.parallelism == "fsdp":  # its processes read their shards from safetensors files only
        fam = models.family(ctx.cfg)
        fsdpload.check_components(fam, model_dir, ctx.cfg.model.expert)
    memory_plan = check_before_training(ctx, model_dir, dev)  # refuses in seconds what would run out of memory
    grace = (memory_plan or {}).get("grace") or STOP_GRACE_S
    ctx.log.info("train: a stop may take up to %d s to finish its step and checkpoint (docs/stopping.md)", grace)
    spec = write_spec(ctx, work, upstream, resume, model_dir, token)
    seen, mark = beside(work, "seen", token), beside(work, "stop", token)
    try:
        with in_use(work):
            cmd = worker_command(ctx.cfg, spec, grace)
            run_workers(ctx, cmd, cwd=work, grace=grace, mark=mark, alone=runs_alone(ctx.cfg))
        # Written by this node's local rank 0 after rank 0's result existed: read before another node can consume
        # the result, so it tells a shared workdir from a node's own even when the result is already gone.
        result_here = seen.is_file() and json.loads(seen.read_text(encoding="utf-8")).get("result_here", False)
    finally:
        for f in (spec, seen, mark):
            f.unlink(missing_ok=True)
    result_path = work / RESULT
    result = json.loads(result_path.read_text(encoding="utf-8")) if result_path.is_file() else None
    if result is None or result.get("launch") != token:
        follow(ctx, work, result_here)  # global rank 0 ran under another node's launch: it publishes
    result_path.unlink()
    (work / IN_USE).unlink(missing_ok=True)
    result.pop("launch")
    result["initialized_from"] = initialized_from
    result["memory_plan"] = memory_plan
    draw_loss_curve(work, result)
    report(ctx, work, result)
    return result


def draw_loss_curve(work: Path, result: dict) -> None:
    """The loss curve of the run's every step and its eval losses, drawn here once the workers are done rather than
    by rank 0 during training: no training process imports matplotlib (~1 CPU-s with the first curve), and no rank
    waits at a barrier while another draws."""
    losses = [row["loss"] for row in read_jsonl(work / LOSSES)]
    loss_curve(losses, eval_losses=result["eval_losses"]).save(work / result["loss_curve"])


def follow(ctx, work: Path, shared: bool) -> None:
    """A node whose workers finished without global rank 0 (torchrun's c10d rendezvous assigns ranks, so
    "node 0" is whichever node got rank 0). On a shared workdir it waits for that node to publish (or fail);
    on a workdir of its own there is nothing to publish here."""
    version = work.name.removeprefix(".").removesuffix(".partial")
    final = ctx.store.version_dir("train", version)
    if not shared and not (final / "manifest.json").is_file():
        raise PublishedElsewhere(
            final,
            f"global rank 0 trained on another node, which publishes version "
            f"{version} in its own workdir; this node's part finished",
        )
    started, deadline = time.time(), time.monotonic() + FOLLOW_TIMEOUT_S
    while not (final / "manifest.json").is_file():
        last = ctx.store.last_failure("train") or {}
        failure = last.get("error") if last.get("version") == version and last.get("at", 0) >= started else None
        if failure or time.monotonic() > deadline:
            raise TrainingFailed(
                f"this node's training finished, but the node running global rank 0 did not "
                f"publish train version {version} within {FOLLOW_TIMEOUT_S} s"
                + (f": {failure}" if failure else "; see that node's log")
            )
        time.sleep(0.5)
    raise PublishedElsewhere(final, f"global rank 0 trained on another node, which published {final}")


def report(ctx, work: Path, result: dict) -> None:
    """A Prefect markdown artifact linking what training wrote, at the path it is about to be published under."""
    published = work.parent / work.name.removeprefix(".").removesuffix(".partial")
    rows = [
        ("final", f"{result['mode']} weights"),
        (result["loss_curve"], "loss curve"),
        *[(c, "checkpoint") for c in result["checkpoints"]],
        *[(s, "validation grid") for s in result["samples"]],
    ]
    table = "\n".join(f"| [{name}]({(published / name).as_uri()}) | {what} |" for name, what in rows)
    ctx.reporter.markdown(
        "train-outputs",
        f"Trained {result['family']} ({result['mode']}) for {result['step']} steps"
        f" on {result['world_size']} process(es).\n\n| file | what |\n|---|---|\n{table}",
        "training outputs",
    )
