"""Sharded cache builds: N independent single processes, each owning a fixed part of a stage's blocks.

The parent (the stage's build) writes a job file beside its work folder, starts one process per shard and waits;
each shard recomputes the same deterministic plan from the scan, encodes only the blocks it owns straight into the
version's work folder (never another shard's), and writes a report. The parent then assembles and verifies every
block in one pass and publishes one version. Shard logs, job and reports live in `<work>.shards/`, outside the
published version. A killed shard loses at most the block in flight: its rerun adopts its finished blocks.

How shards are started is the runner's business: `run_local` starts `python -m tuneline.stages.common.shards`
processes on this machine (each its own GPU through CUDA_VISIBLE_DEVICES when several are visible); the flows
layer passes a runner that starts each shard as a flow run on a Prefect work pool (tuneline.flows.shards), so this
module never imports Prefect.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tuneline.stages.common.artifacts import ArtifactError

RUNNER_KEY = "shard_runner"  # StageContext.cache key: the flows layer's runner, else run_local
# stage -> "module:function" of its shard body: fn(ctx, job, index) -> {"blocks", "encoded", ...}
BODIES = {"latents": "tuneline.stages.latents.shard:run_shard", "text": "tuneline.stages.text.shard:run_shard"}


class ShardFailed(ArtifactError):
    """A shard did not finish: the stage publishes nothing; a rerun resumes the shards' finished blocks."""


@dataclass(frozen=True)
class ShardJob:
    """What every shard of one build needs; written as `<folder>/job.json`."""

    stage: str
    work: str  # the version's work-in-progress folder (absolute)
    count: int
    force: bool
    upstream: dict  # upstream stage -> version
    config: dict  # PipelineConfig.dump()

    @property
    def folder(self) -> Path:
        return shard_folder(Path(self.work))

    def log(self, index: int) -> Path:
        return self.folder / f"shard-{index}.log"

    def report(self, index: int) -> Path:
        return self.folder / f"shard-{index}.json"

    def save(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "job.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__), encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, folder: Path) -> ShardJob:
        return cls(**json.loads((Path(folder) / "job.json").read_text(encoding="utf-8")))


def shard_folder(work: Path) -> Path:
    """Beside the work folder, never in it: nothing here is published (gc treats it as interrupted work)."""
    return work.with_name(work.name + ".shards")


def split(n: int, count: int, index: int) -> range:
    """Shard `index`'s part of n units: contiguous, sizes differing by at most one, the same in every process."""
    return range(n * index // count, n * (index + 1) // count)


def run_shards(ctx, job: ShardJob) -> list[dict]:
    """Start every shard with the context's runner and return their reports in shard order, or raise ShardFailed
    naming each shard that failed and where its log is."""
    for i in range(job.count):
        job.report(i).unlink(missing_ok=True)  # a report from an earlier attempt proves nothing now
    job.save()
    runner: Callable[[ShardJob], dict[int, str]] = ctx.cache.get(RUNNER_KEY) or run_local
    failures = runner(job)  # shard -> why it failed (and where its log is)
    missing = {
        i: f"it wrote no report; see its log {job.log(i)}"
        for i in range(job.count)
        if i not in failures and not job.report(i).is_file()
    }
    failures |= missing
    if failures:
        what = "; ".join(f"shard {i} of {job.count} failed: {why}" for i, why in sorted(failures.items()))
        raise ShardFailed(
            f"{job.stage}: {what}. Nothing was published; finished blocks are kept, so "
            f"`tuneline stage {job.stage}` resumes them"
        )
    return [json.loads(job.report(i).read_text(encoding="utf-8")) for i in range(job.count)]


def run_local(job: ShardJob) -> dict[int, str]:
    """One process per shard on this machine, all at once; shard i gets GPU i % visible GPUs when there are
    several. Returns the failed shards with the reason."""
    gpus = _visible_gpus()
    procs: dict[int, tuple[subprocess.Popen, object]] = {}
    failures = {}
    try:
        for i in range(job.count):
            env = dict(os.environ)
            if len(gpus) > 1:
                env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            log = open(job.log(i), "w", encoding="utf-8")
            cmd = [
                sys.executable,
                "-m",
                "tuneline.stages.common.shards",
                str(job.folder),
                str(i),
                "--parent",
                str(os.getpid()),
            ]
            procs[i] = (
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL),
                log,
            )
        for i, (proc, _) in procs.items():
            rc = proc.wait()
            if rc != 0:
                how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
                failures[i] = f"{how}; see its log {job.log(i)}"
    finally:
        for proc, log in procs.values():  # interrupted while starting or waiting: no shard outlives the stage
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return failures


def _visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def _die_with_parent(parent: int) -> None:
    """Linux: a shard gets SIGKILL when the stage that started it dies, so a killed stage leaves no shard writing
    its blocks (set in the shard itself: a pre-exec hook is unsafe in a threaded parent)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_shard(job: ShardJob, index: int) -> dict:
    """The shard's body in this process; writes and returns its report."""
    from tuneline.schemas.config import parse_config
    from tuneline.stages.common.stage import StageContext

    started = time.monotonic()
    cfg = parse_config(job.config)
    ctx = StageContext(cfg, force=job.force, log=logging.getLogger("tuneline"))
    module, name = BODIES[job.stage].split(":")
    out = getattr(importlib.import_module(module), name)(ctx, job, index)
    report = {"index": index, **out, "seconds": round(time.monotonic() - started, 3), "peak_rss": peak_rss()}
    path = job.report(index)
    path.with_suffix(".tmp").write_text(json.dumps(report), encoding="utf-8")
    os.replace(path.with_suffix(".tmp"), path)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run one shard of a sharded cache build (started by the stage).")
    p.add_argument("folder", type=Path, help="the build's shard folder, holding job.json")
    p.add_argument("index", type=int)
    p.add_argument("--parent", type=int, default=None, help="pid of the stage process (dies with it)")
    a = p.parse_args(argv)
    if a.parent is not None:
        _die_with_parent(a.parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    report = run_shard(ShardJob.load(a.folder), a.index)
    logging.getLogger("tuneline").info("shard %d done: %s", a.index, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
