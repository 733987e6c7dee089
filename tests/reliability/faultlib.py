"""Fault injection shared by `tests/reliability/test_faults.py` (CI, 2 trials per stage) and `bench/faults.py`
(on demand, >= 10 per stage): start a `tuneline` command in its own process group, SIGKILL the whole group at a
seeded random point of a stage's work, then check what docs/design.md promises of a killed run and rerun it.

Only the CLI and the docs/design.md layout are relied on, plus `ArtifactStore.read` to verify what is published.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["scan", "latents", "text", "train", "validate"]
PY = sys.executable
SURVIVOR_GRACE_S = 15.0  # torchrun's agent gets SIGTERM + 5 s to stop its workers, then exits itself


# Config and commands ---------------------------------------------------------------------------------------
def small_config(data_dir: Path, **overrides) -> dict:
    """`tuneline config example`, shrunk: tiny training, small latent blocks, no learning check.

    The dataset lives outside every workdir at an absolute path, so copies of a prepared workdir stay fresh
    (the scan fingerprints the dataset path)."""
    out = subprocess.run(
        [PY, "-m", "tuneline.flows.cli", "config", "example"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    cfg = yaml.safe_load(out.stdout)
    cfg["dataset"].update(path=str(data_dir), demo=True)
    settings = {
        "train.steps": 12,
        # Two ranks: the kill walk checks that every worker of a DDP training dies with the killed run.
        "train.processes": 2,
        "train.checkpoint_every": 3,
        "validate.learning_check": False,
        "validate.steps": 2,
        "latents.block_rows": 8,
    } | overrides
    for dotted, value in settings.items():
        section, key = dotted.split(".", 1)
        if key in cfg.get(section, {}):  # keys come and go while stages evolve; set only those that exist
            cfg[section][key] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def cli_args(*args: str) -> list[str]:
    return [PY, "-m", "tuneline.flows.cli", *args]


def tuneline(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_args(*args), capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env or os.environ.copy()
    )


# What a killed run must leave behind -------------------------------------------------------------------------
def manifest_classes() -> dict:
    from tuneline.stages.pipeline import PIPELINE

    return {sd.name: sd.manifest_cls for sd in PIPELINE}


def visible_partials(workdir: Path) -> list[str]:
    """Every directory under artifacts/<stage>/ without a leading dot must be a published version that verifies."""
    from tuneline.stages.common.artifacts import ArtifactError, ArtifactStore

    store, classes, problems = ArtifactStore(workdir), manifest_classes(), []
    for stage_dir in sorted(p for p in store.root.glob("*") if p.is_dir()):
        for d in sorted(stage_dir.iterdir()):
            if d.name.startswith(".") or not d.is_dir():
                continue
            try:
                store.read(d, classes[stage_dir.name], full=True)
            except (ArtifactError, KeyError) as err:
                problems.append(f"{d}: {err}")
    return problems


def survivors(pids: dict[int, float], workdir: Path, grace: float = SURVIVOR_GRACE_S) -> list[str]:
    """Processes of the killed run still alive after `grace` s: the ones seen while it ran (pid -> start time,
    torchrun's agent and workers included) and any process whose command line names the workdir."""
    deadline = time.monotonic() + grace
    while True:
        alive = [p for p in _alive(pids)] + [p for p in _naming(workdir) if p.pid not in pids]
        if not alive or time.monotonic() >= deadline:
            return [f"pid {p.pid} {' '.join(_cmd(p))[:160]}" for p in alive]
        time.sleep(0.3)


def _alive(pids: dict[int, float]):
    for pid, created in pids.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                yield p
        except psutil.NoSuchProcess:
            pass


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _naming(workdir: Path):
    needle = str(workdir)
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and any(needle in a for a in _cmd(p)):
                yield p
        except psutil.NoSuchProcess:
            pass


def held_locks(workdir: Path) -> list[str]:
    """Locks on files under the workdir that someone still holds: an exclusive non-blocking flock on every
    file named like a lock must succeed, and no file's inode may appear in /proc/locks (any lock, any name)."""
    held: dict[Path, str] = {}
    inodes = {}
    for f in workdir.rglob("*"):
        if not f.is_file() or f.is_symlink():
            continue
        st = f.stat()
        inodes[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = f
        if "lock" in f.name.lower():
            with open(f, "rb") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(fh, fcntl.LOCK_UN)
                except OSError:
                    held[f] = "flock refused"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:123456 0 EOF"
        parts = line.split()
        if len(parts) > 5 and parts[1] != "->" and parts[5].count(":") == 2:
            major, minor, ino = parts[5].split(":")
            f = inodes.get((int(major, 16), int(minor, 16), int(ino)))
            if f is not None:
                held.setdefault(f, f"{parts[1]} lock held by pid {parts[4]}")
    return [f"{f}: {why}" for f, why in sorted(held.items())]


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for f in root.rglob("*"):
        try:
            st = f.lstat()
            out[str(f.relative_to(root))] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            pass
    return out


# Helpers for a killed run -----------------------------------------------------------------------------------
def lock_holder(workdir: Path) -> dict:
    """What the store lock file says about its holder (stages/common/lock.py); {} when absent or unreadable."""
    try:
        info = json.loads((workdir / ".tuneline.lock").read_text(encoding="utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_tree(pid: int, seen: dict[int, float]) -> None:
    """Note `pid` and its descendants (pid -> start time): torchrun's agent and workers leave the process group
    (new sessions), so only this record finds them after the kill."""
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            seen.setdefault(p.pid, p.create_time())
    except psutil.NoSuchProcess:
        pass


def count_workers(seen: dict[int, float]) -> int:
    """Training workers (`-m tuneline.stages.train.worker`) among the live processes seen."""
    return sum(any("tuneline.stages.train.worker" == a for a in _cmd(p)) for p in _alive(seen))


def check_after_kill(workdir: Path, seen: dict[int, float]) -> list[str]:
    """Nothing of the killed run still runs or writes, no lock is held, no partial version is visible."""
    problems = [f"still running after the kill: {s}" for s in survivors(seen, workdir)]
    before = tree_state(workdir)
    time.sleep(1.0)
    if tree_state(workdir) != before:
        problems.append("files under the workdir still change after the kill")
    problems += [f"lock outlived its holder: {x}" for x in held_locks(workdir)]
    problems += [f"partial artifact visible as a version: {x}" for x in visible_partials(workdir)]
    return problems


def published(workdir: Path, stage: str) -> set[str]:
    d = workdir / "artifacts" / stage
    return {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")} if d.is_dir() else set()


def drop_stage(workdir: Path, stage: str) -> None:
    """Forget a stage and everything downstream, so the next run builds them from scratch."""
    for s in STAGES[STAGES.index(stage) :]:
        shutil.rmtree(workdir / "artifacts" / s, ignore_errors=True)


def train_slots(env: dict) -> int | None:
    """Active slots of the `tuneline-train` global concurrency limit on the server `env` points at."""
    url = env["PREFECT_API_URL"] + "/v2/concurrency_limits/tuneline-train"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(json.loads(r.read())["active_slots"])
    except OSError:
        return None
