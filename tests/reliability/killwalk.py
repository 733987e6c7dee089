"""A kill walk: `tuneline run` again and again on one workdir, each run SIGKILLed (whole process group) at a seeded
random point of a chosen stage, until every stage has taken its share of kills; then one run to completion.

Each run must first finish what the killed run left (it resumes the stage's `.partial` directory) before the
walk can move on, so the walk checks "rerun completes and reuses the killed run's work" for every kill, and a
stage killed twice in a row checks resuming a resumed build. Kills are aimed by the store lock: a run is in
stage X while `<workdir>/.tuneline.lock` names our pid and "stage X" (stages/common/lock.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.helpers import spawn
from tests.reliability import faultlib as fl

# Seconds from a stage taking the store lock to its publish, on 2 busy cores (tiny config of faultlib): kill
# points are drawn over this span. Short stages are mostly import and model loading.
DURATION_S = {"scan": 1.0, "latents": 12.0, "text": 1.5, "train": 45.0, "validate": 6.0}
# The lock is polled every 0.03 s (kills are aimed to that precision); the process tree is walked less often: a
# walk reads every process of the machine (~1.6 ms of CPU on 2 cores, 5% of a core at the lock's pace). Only
# processes that leave the tree before the kill depend on it: the tree is walked again just before the kill.
TREE_SCAN_S = 0.25


@dataclass
class Kill:
    target: str
    delay: float  # seconds after the target stage took the lock
    landed: str = ""  # the stage the run was in at the kill ("-" = none: startup or between stages)
    phase: str = ""  # "build": its .partial directory existed; "prepare": checks, model loading
    partial: str | None = None
    progress: dict = field(default_factory=dict)  # latents: rows in finished blocks; train: checkpoints
    workers: int = 0  # torchrun processes (agent + workers) alive at the kill; workers run in their own sessions
    problems: list[str] = field(default_factory=list)


@dataclass
class Walk:
    kills: list[Kill] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # every problem, the kills' own included
    final: list[str] = field(default_factory=list)  # problems of the final run to completion
    runs: int = 0
    seconds: float = 0.0

    def aimed(self, stage: str) -> int:
        """Kills aimed at `stage` that landed in it (a kill drawn past its end lands in the next stage)."""
        return sum(k.target == k.landed == stage for k in self.kills)

    def summary(self) -> str:
        rows = [f"{len(self.kills)} kills in {self.runs} runs, {self.seconds:.0f} s"]
        for s in fl.STAGES:
            ks = [k for k in self.kills if k.landed == s]
            build = sum(k.phase == "build" for k in ks)
            rows.append(f"{s}: {len(ks)} ({build} during its build, {len(ks) - build} while preparing)")
        rows.append(f"outside any stage: {sum(k.landed == '-' for k in self.kills)}")
        return "; ".join(rows)


def stage_progress(stage: str, partial: Path) -> dict:
    """What the stage recorded as finished in its partial directory: the work a rerun must not redo."""
    if stage == "latents":
        rows = 0
        for rec in (partial / "blocks").glob("*/*.json"):
            try:
                rows += len(json.loads(rec.read_text(encoding="utf-8"))["paths"])
            except (ValueError, KeyError, OSError):
                pass
        return {"rows": rows}
    if stage == "train":
        return {
            "checkpoints": sorted(
                p.name for p in (partial / "checkpoints").glob("step-*") if (p / "state.json").is_file()
            )
        }
    return {}


def _partials(workdir: Path, stage: str) -> list[str]:
    d = workdir / "artifacts" / stage
    return sorted(p.name for p in d.glob(".*.partial")) if d.is_dir() else []


def _in_stage(workdir: Path, pid: int) -> str:
    info = fl.lock_holder(workdir)
    if info.get("pid") != pid:
        return "-"
    purpose = str(info.get("purpose", ""))
    return next((s for s in fl.STAGES if f"stage {s}" in purpose), "-")


class _Timer:
    """Times the stages a run passes through: lock taken with "stage X" -> a new version of X published."""

    def __init__(self, workdir: Path, pid: int, durations: dict[str, float]):
        self.workdir, self.pid, self.durations = workdir, pid, durations
        self.before = {s: fl.published(workdir, s) for s in fl.STAGES}
        self.started: dict[str, float] = {}

    def poll(self) -> str:
        now, current = time.monotonic(), _in_stage(self.workdir, self.pid)
        if current != "-":
            self.started.setdefault(current, now)
        for s, t0 in list(self.started.items()):
            if s in self.durations or fl.published(self.workdir, s) == self.before[s]:
                continue
            self.durations[s] = max(0.2, now - t0)
        return current


def _has_progress(workdir: Path, stage: str) -> bool:
    parts = _partials(workdir, stage)
    return bool(parts) and any(stage_progress(stage, workdir / "artifacts" / stage / parts[-1]).values())


def kill_run(
    workdir: Path,
    config: Path,
    target: str,
    delay: float,
    env: dict,
    log: Path,
    observed: dict[str, float],
    after_progress: bool = False,
) -> Kill | None:
    """One `tuneline run`, SIGKILLed `delay` s after it enters `target` (after_progress: after the stage first
    records finished work, a latent block or a checkpoint); None when it never got there.
    Stage durations seen on the way (stages it completed) are added to `observed`."""
    kill = Kill(target, delay)
    with open(log, "ab") as out:
        proc = spawn(fl.cli_args("run", str(config), "--workdir", str(workdir)), out, env)
    seen: dict[int, float] = {}
    timer = _Timer(workdir, proc.pid, observed)

    def watch(seconds: float, until=lambda stage: False) -> bool:
        deadline, scanned = time.monotonic() + seconds, 0.0
        while time.monotonic() < deadline and proc.poll() is None:
            if time.monotonic() - scanned >= TREE_SCAN_S:
                fl.remember_tree(proc.pid, seen)
                scanned = time.monotonic()
            if until(timer.poll()):
                return True
            time.sleep(0.03)
        return False

    if not watch(900, lambda stage: stage == target):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return (
            None
            if proc.returncode == 0
            else Kill(
                target,
                delay,
                problems=[f"run ended (exit {proc.returncode}) without reaching {target} within 900 s; see {log}"],
            )
        )
    if after_progress:
        # Until the stage records finished work, or publishes (it finished first). Not "the lock holder changed":
        # between two lock polls the holder can read as nobody while the stage is still running.
        published = fl.published(workdir, target)
        watch(600, lambda stage: _has_progress(workdir, target) or fl.published(workdir, target) != published)
    watch(delay)
    fl.remember_tree(proc.pid, seen)
    kill.landed = _in_stage(workdir, proc.pid)
    kill.workers = fl.count_workers(seen)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group, as a scheduler or `kill -9 -PGID` would
    proc.wait()
    if proc.returncode == 0:
        return None  # the kill point lay past the end of the whole run: no trial
    if proc.returncode != -signal.SIGKILL:
        kill.problems.append(f"the run failed on its own (exit {proc.returncode}) before the kill; see {log}")
    kill.problems += fl.check_after_kill(workdir, seen)
    # Read once every process of the run is gone: this is exactly the work the next run can find.
    stage = kill.landed if kill.landed != "-" else target
    parts = _partials(workdir, stage)
    kill.partial = parts[-1] if parts else None
    kill.phase = "build" if kill.partial else "prepare"
    if kill.partial:
        kill.progress = stage_progress(stage, workdir / "artifacts" / stage / kill.partial)
    return kill


def config_for(workdir: Path, config: Path) -> Path:
    """The walk's config, with train.resume: latest once the killed training left a checkpoint (continuing a
    run's own checkpoints is opt-in; resume is not fingerprinted, so the version stays the same)."""
    parts = _partials(workdir, "train")
    if not parts or not stage_progress("train", workdir / "artifacts" / "train" / parts[-1])["checkpoints"]:
        return config
    cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
    cfg["train"]["resume"] = "latest"
    return fl.write_config(config.with_name(config.stem + "-resume.yaml"), cfg)


def walk(
    workdir: Path,
    config: Path,
    env: dict,
    kills_per_stage: int,
    seed: int,
    log: Path,
    durations: dict[str, float] = DURATION_S,
) -> Walk:
    rng, result, started = random.Random(seed), Walk(), time.monotonic()
    pending: dict[str, Kill] = {}  # stage -> its last kill, checked once the stage publishes
    observed: dict[str, float] = {}  # stage durations measured in this walk replace the priors
    for stage in fl.STAGES:
        attempts = 0
        while result.aimed(stage) < kills_per_stage and attempts < kills_per_stage + 4:
            attempts += 1
            if fl.published(workdir, stage):  # the last kill came after its publish: build it again
                fl.drop_stage(workdir, stage)
                for s in fl.STAGES[fl.STAGES.index(stage) :]:
                    pending.pop(s, None)  # their partial work is gone with them
            # Every second kill of a stage that records progress waits for its first block/checkpoint, so each
            # walk checks that a rerun keeps finished work; the others are spread over the whole stage.
            at_progress = stage in ("latents", "train") and result.aimed(stage) % 2 == 1
            span = 0.05 if at_progress else observed.get(stage, durations[stage])  # small builds finish fast
            delay = round(rng.uniform(0, span), 2)
            k = kill_run(workdir, config_for(workdir, config), stage, delay, env, log, observed, at_progress)
            result.runs += 1
            if k is None:
                continue
            result.kills.append(k)
            result.problems += [f"kill in {k.landed} ({k.phase}) {delay:.2f}s into {stage}: {p}" for p in k.problems]
            if k.landed != "-":
                pending[k.landed] = k
            result.problems += _settled(workdir, pending)
    out = fl.tuneline("run", str(config_for(workdir, config)), "--workdir", str(workdir), env=env, timeout=1800)
    result.runs += 1
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(out.stdout + out.stderr)
    if out.returncode != 0:
        result.final.append(f"the final run failed (exit {out.returncode}): {out.stderr.strip()[-600:]}")
    result.problems += _settled(workdir, pending)
    result.final += fl.visible_partials(workdir)
    result.final += [f"{s}: not published after the final run" for s in fl.STAGES if not fl.published(workdir, s)]
    result.problems += result.final
    result.seconds = time.monotonic() - started
    return result


def _settled(workdir: Path, pending: dict[str, Kill]) -> list[str]:
    """For each killed stage that has published since: it published from the killed run's partial directory.
    Problems are also added to the kill's own list."""
    out = []
    for stage in [s for s in pending if fl.published(workdir, s)]:
        k = pending.pop(stage)
        problems = _reused(workdir, stage, k)
        k.problems += problems
        out += [f"{stage}: {p}" for p in problems]
    return out


def _reused(workdir: Path, stage: str, k: Kill) -> list[str]:
    if k.partial is None:
        return []
    problems: list[str] = []
    key = k.partial.removeprefix(".").removesuffix(".partial")
    stage_dir = workdir / "artifacts" / stage
    index = (
        json.loads((stage_dir / ".index.json").read_text(encoding="utf-8"))
        if (stage_dir / ".index.json").is_file()
        else {}
    )
    version = index.get(key, key)
    if not (stage_dir / version / "manifest.json").is_file():
        return [
            f"published {sorted(fl.published(workdir, stage))}, not {version}, the version of the killed "
            f"run's {k.partial}"
        ]
    if (stage_dir / k.partial).exists():
        problems.append(f"{k.partial} is still there after {version} was published")
    manifest = json.loads((stage_dir / version / "manifest.json").read_text(encoding="utf-8"))
    rows, ckpts = k.progress.get("rows", 0), k.progress.get("checkpoints")
    if stage == "latents" and manifest.get("resumed", 0) < rows:
        problems.append(
            f"the rerun resumed {manifest.get('resumed')} rows, but {rows} were in "
            f"finished blocks at the kill (work lost > one block)"
        )
    resumed = re.search(r"step-(\d+)", str(manifest.get("resumed_from") or ""))
    if stage == "train" and ckpts and (resumed is None or int(resumed.group(1)) < int(ckpts[-1].split("-")[1])):
        problems.append(
            f"the rerun resumed from {manifest.get('resumed_from')!r}, not {ckpts[-1]}, the "
            f"last checkpoint at the kill (work lost > one checkpoint interval)"
        )
    return problems
