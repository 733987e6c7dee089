"""The training processes of one launch: torchrun and its DDP workers, or one worker alone. Starts them, streams
their output to the stage log, forwards a stop, and turns how they ended into the stage's error (the rank that failed
first, a stop, the output's tail) with where training can continue from."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tuneline.stages.families import resolve as models
from tuneline.stages.train import checkpoint as ckpt, fsdp
from tuneline.stages.train.checkpoint import CHECKPOINTS
from tuneline.stages.train.failcause import ERROR, TRACEBACK, Causes, first_failure
from tuneline.stages.train.failures import FAILED_AS, TrainingFailed, TrainingOutOfMemory, TrainingStopped
from tuneline.stages.train.procwatch import PARENT_ENV
from tuneline.stages.train.stopping import STOP_GRACE_S

STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")

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
    """The error of a launch (torchrun, or the worker alone) that exited with `rc`: a stop that reached the workers and
    not us (a scheduler signalling every process), the rank that failed first (tuneline.stages.train.failcause), or
    the output."""
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
