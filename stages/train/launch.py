"""Start training (torchrun and its DDP workers, or one worker alone), stream its output to the stage log, collect
the result."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
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
from tuneline.stages.train import checkpoint as ckpt, collectives, fsdp, fsdpload, init_source
from tuneline.stages.train.checkpoint import CHECKPOINTS
from tuneline.stages.train.failcause import ERROR, LOSSES, RESULT, TRACEBACK, Causes, first_failure
from tuneline.stages.train.failures import FAILED_AS, TrainingFailed, TrainingOutOfMemory, TrainingStopped
from tuneline.stages.train.memcheck import check_before_training
from tuneline.stages.train.procwatch import PARENT_ENV
from tuneline.stages.train.stopping import STOP_GRACE_S

STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")
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


WORKER = ["-m", "tuneline.stages.train.worker"]
AGENT = "tuneline.stages.train.procwatch"
# What torchrun gives its workers, for one process started without it: rank 0 of 1, whose process group's store
# listens on a port the system picks (no other process needs to find it).
ALONE_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "GROUP_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "0",
}


def runs_alone(cfg) -> bool:
    return cfg.train.processes == 1 and cfg.train.nodes == 1


def worker_command(cfg, spec: Path, grace: int = STOP_GRACE_S) -> list[str]:
    """One process on one node is started alone: torchrun's agent would add an interpreter importing torch (~2 CPU-s
    and a second of start-up) to host a rendezvous nobody joins. More processes, or nodes, run under torchrun, which
    waits `grace` seconds for its workers after forwarding a stop (its default, 30 s, would cut a long step or
    checkpoint short and fall back to the last periodic checkpoint); alone, the launcher waits that long itself."""
    t = cfg.train
    if runs_alone(cfg):
        return [sys.executable, "-u", *WORKER, str(spec)]
    cmd = [sys.executable, "-m", AGENT, f"--nproc_per_node={t.processes}", f"--shutdown-timeout={grace}"]
    if t.nodes > 1:
        cmd += [
            f"--nnodes={t.nodes}",
            f"--node_rank={t.node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={t.rdzv_endpoint}",
            f"--rdzv_id={t.rdzv_id}",
        ]
    else:
        cmd += ["--standalone"]
    return cmd + [*WORKER, str(spec)]


def run_workers(
    ctx, cmd: list[str], cwd: Path, grace: int = STOP_GRACE_S, mark: Path | None = None, alone: bool = False
) -> None:
    """Run `cmd` (worker_command's: torchrun, or the worker `alone`) to its end; a failure raised as the error that
    names its cause (failed)."""
    env = dict(os.environ)
    if alone:  # nothing of an agent it is not under (TORCHELASTIC_USE_AGENT_STORE would make it look for one)
        env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")} | ALONE_ENV
    env[PARENT_ENV] = str(os.getpid())
    env["OMP_NUM_THREADS"] = str(ctx.cfg.train.threads_per_process)
    env["PYTHONUNBUFFERED"] = "1"
    env |= fsdp.host_memory_env(ctx.cfg.train, models.device(ctx.cfg), env)
    # The project root must be importable by the workers even when not installed (tests, dev checkouts).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    ctx.log.debug("train: %s", " ".join(cmd))  # our own launcher's command line: for debugging, not news
    # Its own session: a SIGTERM to our process group (a cancelled run, `kill -TERM -PGID`) reaches torchrun (or the
    # worker alone) once, forwarded below, not twice (a second SIGTERM cuts torchrun's wait for its workers'
    # checkpoint short). SIGKILL needs no forwarding: torchrun and its workers die with this process (procwatch).
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    restore = raise_on_sigterm()
    tail: list[str] = []
    causes = Causes()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-30:]
            causes.feed(line)
            ctx.log.info("%s", line)
            report_progress(ctx, line)
        rc = proc.wait()
    except BaseException:
        stop(ctx, proc, grace, mark)
        stopped = stop_record(cwd)
        if stopped:
            raise TrainingStopped(stopped) from None
        raise
    finally:
        restore()
    if rc < 0 and alone:  # what torchrun's summary says of a worker a signal ended
        causes.exits[0] = (rc, signal_name(-rc))
    if rc != 0:
        raise failed(cwd, rc, tail, causes)


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal has no name of its own
        return f"signal {number}"


def failed(work: Path, rc: int, tail: list[str], causes: Causes) -> TrainingFailed:
    """The error of a torchrun that exited with `rc`: a stop that reached the workers and not us (a scheduler
    signalling every process), the rank that failed first (tuneline.stages.train.failcause), or the output."""
    stopped = stop_record(work)
    if stopped:
        return TrainingStopped(stopped)
    failure = first_failure(work, causes)
    if failure is not None:
        return FAILED_AS.get(failure.kind, TrainingFailed)(with_checkpoint(work, failure.message))
    explained = causes.explain()
    cls = TrainingOutOfMemory if any(h.startswith("out of memory") for h in causes.hints) else TrainingFailed
    return cls(failure_message(work, rc, tail, explained))


def stop(ctx, proc: subprocess.Popen, grace: int, mark: Path | None) -> None:
    """A stop (SIGTERM, Ctrl-C, a cancelled flow run): marked as one, then forwarded to torchrun (or the worker
    alone), whose workers finish the step, checkpoint and exit (tuneline.stages.train.stopping) within `grace`
    seconds."""
    if mark is not None:
        mark.write_text("{}", encoding="utf-8")
    ctx.log.warning("train: stopping; the workers finish their step and checkpoint (up to %d s)", grace)
    # To its process group, as torchrun signals its workers': a worker alone takes what it started along (torchrun's
    # own group is torchrun alone; its workers have sessions of their own).
    group_signal(proc, signal.SIGTERM)
    # Still read its output: a full pipe would block the workers' prints, and with them the checkpoint.
    threading.Thread(target=drain, args=(ctx, proc), daemon=True).start()
    try:
        proc.wait(timeout=grace + 10)  # torchrun itself kills its workers after `grace`; a worker alone, we do
    except subprocess.TimeoutExpired:
        group_signal(proc, signal.SIGKILL)


def group_signal(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group `proc` leads (started in a session of its own), unless it has ended."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def drain(ctx, proc: subprocess.Popen) -> None:
    """A stopping torchrun's output into the log; from torchrun's own traceback of the signal on (it reports the
    stop it was asked for, not a failure) at debug level only."""
    level = logging.INFO
    for line in proc.stdout:
        if TRACEBACK.match(line):
            level = logging.DEBUG
        ctx.log.log(level, "%s", line.rstrip())


def stop_record(work: Path) -> str | None:
    """The reason rank 0 left when it stopped on request after a checkpoint, or None."""
    try:
        data = json.loads((work / ERROR).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data.get("error") if data.get("stopped") else None


def raise_on_sigterm():
    """Outside Prefect (which turns SIGTERM into an exception itself) SIGTERM would end this process at once and
    take torchrun with it: raise instead, so the forwarding above lets the workers checkpoint. Returns the undo."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return lambda: None

    def stop(signum, frame):
        raise TrainingFailed("training was stopped (SIGTERM); its last checkpoint is kept for the next run")

    signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def report_progress(ctx, line: str) -> None:
    m = STEP_LINE.match(line)
    if m:
        step, total = int(m.group(1)), int(m.group(2))
        ctx.reporter.progress("train-progress", step / total, f"step {step}/{total}")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def failure_message(work: Path, rc: int, tail: list[str], cause: str | None = None) -> str:
    """The worker's own explanation when it left one (NaN loss, bad checkpoint), else the exception its output
    shows (tuneline.stages.train.failcause), else the output's tail."""
    try:
        msg = json.loads((work / ERROR).read_text(encoding="utf-8"))["error"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        if cause:
            return f"training failed (exit code {rc}): {cause}. The full output is in the stage log"
        return f"training exited with code {rc}; last output:\n" + "\n".join(tail[-12:])
    return with_checkpoint(work, msg)


def with_checkpoint(work: Path, msg: str) -> str:
    """`msg` and where training can continue from."""
    found = ckpt.listed(work / CHECKPOINTS)
    if found:
        return msg + (
            f". Training stopped; the last good checkpoint is {found[-1][1]} (step {found[-1][0]}): fix the "
            f"cause, then set train.resume to that path to continue from it (latest finds it only while every "
            f"fingerprinted train setting stays the same)"
        )
    return msg + ". Training stopped before its first checkpoint"


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
