"""Start DDP training as a torchrun subprocess, stream its output to the stage log, collect the result."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from stages.common import models
from stages.train.procwatch import PARENT_ENV

RESULT = "result.json"


class TrainingFailed(RuntimeError):
    pass


def write_spec(ctx, work: Path, upstream: dict) -> Path:
    """Everything a worker needs, by path: each rank re-reads and re-verifies the same manifests."""
    spec = {
        "config": ctx.cfg.dump(),
        "model_dir": str(models.model_dir(ctx)),
        "out_dir": str(work),
        "upstream": {name: str(models.artifact_dir(ctx, m)) for name, m in upstream.items()},
    }
    path = work / "spec.json"
    path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return path


def torchrun_command(cfg, spec: Path) -> list[str]:
    t = cfg.train
    cmd = [sys.executable, "-m", "stages.train.procwatch", f"--nproc_per_node={t.processes}"]
    if t.nodes > 1:
        cmd += [f"--nnodes={t.nodes}", f"--node_rank={t.node_rank}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={t.rdzv_endpoint}", f"--rdzv_id={t.rdzv_id}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "stages.train.worker", str(spec)]


def run_torchrun(ctx, cmd: list[str], cwd: Path) -> None:
    env = dict(os.environ)
    env[PARENT_ENV] = str(os.getpid())
    env["OMP_NUM_THREADS"] = str(ctx.cfg.train.threads_per_process)
    env["PYTHONUNBUFFERED"] = "1"
    # The project root must be importable by the workers even when not installed (tests, dev checkouts).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    ctx.log.info("train: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    tail: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-30:]
            ctx.log.info("%s", line)
        rc = proc.wait()
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # torchrun stops its workers on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if rc != 0:
        raise TrainingFailed(f"training exited with code {rc}; last output:\n" + "\n".join(tail[-12:]))


def build(ctx, work: Path, upstream: dict) -> dict:
    (work / RESULT).unlink(missing_ok=True)
    spec = write_spec(ctx, work, upstream)
    run_torchrun(ctx, torchrun_command(ctx.cfg, spec), cwd=work)
    result_path = work / RESULT
    if not result_path.is_file():
        raise TrainingFailed(f"training finished without writing {result_path}: see the log above")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    result_path.unlink()
    spec.unlink()
    return result
