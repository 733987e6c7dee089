"""Fault injection shared by `tests/reliability/test_faults.py` (CI, 2 trials per stage) and `bench/faults.py`
(on demand, >= 10 per stage): start a `tuneline` command in its own process group, SIGKILL the whole group at a
seeded random point of a stage's work, then check what CONTRACT.md promises of a killed run and rerun it.

Only the CLI and the CONTRACT.md layout are relied on, plus `ArtifactStore.read` to verify what is published.
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
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
    out = subprocess.run([PY, "-m", "flows.cli", "config", "example"], capture_output=True, text=True, cwd=ROOT,
                         check=True)
    cfg = yaml.safe_load(out.stdout)
    cfg["dataset"].update(path=str(data_dir), demo=True)
    settings = {"train.steps": 12, "train.processes": 2, "train.checkpoint_every": 3,
                "validate.learning_check": False, "validate.steps": 2, "latents.block_rows": 8} | overrides
    for dotted, value in settings.items():
        section, key = dotted.split(".", 1)
        if key in cfg.get(section, {}):  # keys come and go while stages evolve; set only those that exist
            cfg[section][key] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def cli_args(*args: str) -> list[str]:
    return [PY, "-m", "flows.cli", *args]


def tuneline(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cli_args(*args), capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=env or os.environ.copy())


class PrefectServer:
    """One Prefect server for a batch of CLI runs: each run then skips starting its own temporary server
    (~10 s of CPU on 2 cores), which is what makes dozens of killed runs affordable."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="tuneline-rel-prefect-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.env = os.environ | {"PREFECT_HOME": str(self.home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                                 "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(self.home / "results"),
                                 "PREFECT_API_URL": f"http://127.0.0.1:{self.port}/api"}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PrefectServer":
        env = dict(self.env)
        env.pop("PREFECT_API_URL")
        self.proc = subprocess.Popen([PY, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                      str(self.port)], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/health", timeout=2):
                    return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError("prefect server did not become healthy in 120 s")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


# What a killed run must leave behind -------------------------------------------------------------------------
def manifest_classes() -> dict:
    from stages.pipeline import PIPELINE

    return {sd.name: sd.manifest_cls for sd in PIPELINE}


def visible_partials(workdir: Path) -> list[str]:
    """Every directory under artifacts/<stage>/ without a leading dot must be a published version that verifies."""
    from stages.common.artifacts import ArtifactError, ArtifactStore

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
    """Lock files under the workdir that someone still holds: try an exclusive flock on each (non-blocking),
    and look up every file's inode in /proc/locks (covers fcntl/POSIX locks and any lock file name)."""
    problems = []
    inodes = {}
    for f in workdir.rglob("*"):
        if f.is_file() and not f.is_symlink():
            st = f.stat()
            inodes[(os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)] = f
            if "lock" in f.name.lower():
                with open(f, "rb") as fh:
                    try:
                        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        fcntl.flock(fh, fcntl.LOCK_UN)
                    except OSError:
                        problems.append(f"{f} is still flock-ed")
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split()
        if len(parts) > 5 and parts[1] != "->" and parts[5].count(":") == 2:
            major, minor, ino = parts[5].split(":")
            f = inodes.get((int(major, 16), int(minor, 16), int(ino)))
            if f is not None and "flock-ed" not in " ".join(problems):
                problems.append(f"{f} is locked by pid {parts[4]} ({parts[1]})")
    return problems


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for f in root.rglob("*"):
        try:
            st = f.lstat()
            out[str(f.relative_to(root))] = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            pass
    return out


# One trial ------------------------------------------------------------------------------------------------
@dataclass
class Kill:
    stage: str
    delay: float  # seconds after the stage started working
    landed: str = ""  # "before" its partial directory exists, "during" the build, or "after" it published
    partial: str | None = None  # the stage's .partial directory at the kill
    progress: dict = field(default_factory=dict)  # latents: rows in finished blocks; train: checkpoints
    problems: list[str] = field(default_factory=list)


def stage_progress(stage: str, partial: Path) -> dict:
    """What the stage recorded as finished in its partial directory (the work a rerun must not redo)."""
    if stage == "latents":
        rows = 0
        for rec in sorted((partial / "blocks").glob("*/*.json")):
            try:
                rows += len(json.loads(rec.read_text(encoding="utf-8"))["paths"])
            except (ValueError, KeyError, OSError):
                pass
        return {"rows": rows}
    if stage == "train":
        done = sorted(p.name for p in (partial / "checkpoints").glob("step-*") if (p / "state.json").is_file())
        return {"checkpoints": done}
    return {}


def _partials(workdir: Path, stage: str) -> set[str]:
    d = workdir / "artifacts" / stage
    return {p.name for p in d.glob(".*.partial")} if d.is_dir() else set()


def _published(workdir: Path, stage: str) -> set[str]:
    d = workdir / "artifacts" / stage
    return {p.name for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")} if d.is_dir() else set()


def _started(proc: subprocess.Popen, workdir: Path, stage: str, before: set[str]) -> bool:
    """The stage is working: it holds the store lock, or a new partial directory appeared."""
    info = _lock_holder(workdir)
    if info.get("pid") == proc.pid and stage in str(info.get("purpose", stage)):
        return True
    return bool(_partials(workdir, stage) - before)


def _lock_holder(workdir: Path) -> dict:
    """What the store lock file says about its holder (stages/common/lock.py); {} when absent or unreadable."""
    try:
        info = json.loads((workdir / ".tuneline.lock").read_text(encoding="utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def kill_trial(workdir: Path, config: Path, stage: str, delay: float, env: dict, log: Path,
               extra: tuple[str, ...] = ()) -> Kill:
    """`tuneline stage STAGE` in its own process group, SIGKILLed `delay` s after the stage starts working."""
    kill = Kill(stage, delay)
    before = _partials(workdir, stage)
    published_before = _published(workdir, stage)
    with open(log, "ab") as out:
        proc = subprocess.Popen(cli_args("stage", stage, str(config), "--workdir", str(workdir), *extra), cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, float] = {}

    def watch(until: float, cond=lambda: False) -> bool:
        while time.monotonic() < until and proc.poll() is None:
            _remember(proc.pid, seen)
            if cond():
                return True
            time.sleep(0.1)
        return False

    watch(time.monotonic() + 600, lambda: _started(proc, workdir, stage, before))
    watch(time.monotonic() + delay)
    _remember(proc.pid, seen)
    finished = proc.poll() is not None
    parts = sorted(_partials(workdir, stage))
    kill.partial = parts[-1] if parts else None
    if kill.partial:
        kill.progress = stage_progress(stage, workdir / "artifacts" / stage / kill.partial)
    if not finished:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if finished or _published(workdir, stage) - published_before:
        kill.landed = "after"  # it had published: the kill hits the tail (reporting, flow teardown)
    else:
        kill.landed = "during" if kill.partial else "before"  # before: upstream checks, model loading
    if finished and proc.returncode != 0:
        kill.problems.append(f"the run failed on its own (exit {proc.returncode}); see {log}")
    kill.problems += check_after_kill(workdir, seen)
    return kill


def _remember(pid: int, seen: dict[int, float]) -> None:
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            seen.setdefault(p.pid, p.create_time())
    except psutil.NoSuchProcess:
        pass


def check_after_kill(workdir: Path, seen: dict[int, float]) -> list[str]:
    problems = [f"still running after the kill: {s}" for s in survivors(seen, workdir)]
    before = tree_state(workdir)
    time.sleep(1.0)
    if tree_state(workdir) != before:
        problems.append("files under the workdir still change after the kill")
    problems += [f"lock outlived its holder: {x}" for x in held_locks(workdir)]
    problems += [f"partial artifact visible as a version: {x}" for x in visible_partials(workdir)]
    return problems


def rerun(workdir: Path, config: Path, stage: str, last: Kill, env: dict, log: Path) -> list[str]:
    """Run the stage to completion; it must publish a version that verifies, reusing the killed run's work."""
    from stages.common.artifacts import ArtifactError, ArtifactStore

    cfg_path = config
    if stage == "train" and last.progress.get("checkpoints"):
        # Continuing a run's own checkpoints is opt-in (train.resume: latest; not fingerprinted, same version).
        cfg = yaml.safe_load(config.read_text(encoding="utf-8"))
        cfg["train"]["resume"] = "latest"
        cfg_path = write_config(config.with_name(config.stem + "-resume.yaml"), cfg)
    out = tuneline("stage", stage, str(cfg_path), "--workdir", str(workdir), env=env)
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(out.stdout + out.stderr)
    if out.returncode != 0:
        return [f"rerun of {stage} failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}"]
    path = Path(out.stdout.strip().splitlines()[-1])
    try:
        manifest = ArtifactStore(workdir).read(path, manifest_classes()[stage], full=True)
    except ArtifactError as err:
        return [f"rerun published {path}, which does not verify: {err}"]
    return work_reused(workdir, stage, last, manifest, path)


def work_reused(workdir: Path, stage: str, last: Kill, manifest, path: Path) -> list[str]:
    """Work lost <= one block / checkpoint interval: the rerun built from the killed run's partial directory."""
    if last.landed != "during" or last.partial is None:
        return []
    key = last.partial.removeprefix(".").removesuffix(".partial")
    problems = []
    index = json.loads((path.parent / ".index.json").read_text(encoding="utf-8")) \
        if (path.parent / ".index.json").is_file() else {}
    if path.name != key and index.get(key) != path.name:
        problems.append(f"rerun published {path.name}, not the version of the killed run's partial {last.partial}")
    if (path.parent / last.partial).exists():
        problems.append(f"{last.partial} is still there after the rerun published {path.name}")
    rows = last.progress.get("rows", 0)
    if stage == "latents" and getattr(manifest, "resumed", 0) < rows:
        problems.append(f"latents rerun resumed {manifest.resumed} rows; {rows} were in finished blocks at the kill")
    ckpts = last.progress.get("checkpoints")
    if stage == "train" and ckpts and not str(getattr(manifest, "resumed_from", "") or "").endswith(ckpts[-1]):
        problems.append(f"train rerun resumed from {getattr(manifest, 'resumed_from', None)!r}, not {ckpts[-1]}")
    return problems


def stage_trials(base: Path, scratch: Path, config: Path, stage: str, delays: list[float], env: dict,
                 kills_per_rerun: int = 2) -> tuple[list[Kill], list[str]]:
    """Chained trials on copies of a prepared workdir: `kills_per_rerun` kills in a row (each run resumes the
    last one's partial work), then a rerun to completion. Returns the kills and every problem found."""
    kills, problems = [], []
    for i in range(0, len(delays), kills_per_rerun):
        work = scratch / f"{stage}-{i}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work, symlinks=True)
        drop_stage(work, stage)
        log = scratch / f"{stage}-{i}.log"
        for delay in delays[i:i + kills_per_rerun]:
            k = kill_trial(work, config, stage, delay, env, log)
            kills.append(k)
            problems += [f"{stage} kill after {delay:.1f}s: {p}" for p in k.problems]
        problems += [f"{stage} rerun: {p}" for p in rerun(work, config, stage, kills[-1], env, log)]
        shutil.rmtree(work, ignore_errors=True)
    return kills, problems


def prepare(workdir: Path, config: Path, env: dict, log: Path) -> dict[str, float]:
    """`tuneline run` once into `workdir`; returns each stage's working time (partial dir seen -> published)."""
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            now = time.monotonic()
            purpose = str(_lock_holder(workdir).get("purpose", ""))
            for s in STAGES:
                if s not in started and (f"stage {s}" in purpose or _partials(workdir, s)):
                    started[s] = now
                if s not in done and _published(workdir, s):
                    done[s] = now
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = tuneline("run", str(config), "--workdir", str(workdir), env=env, timeout=1800)
    finally:
        stop.set()
        t.join()
    log.write_text(out.stdout + out.stderr, encoding="utf-8")
    if out.returncode != 0:
        raise RuntimeError(f"preparing {workdir} failed (exit {out.returncode}); see {log}: "
                           f"{out.stderr.strip().splitlines()[-1:]}")
    return {s: max(0.5, done.get(s, 0) - started.get(s, done.get(s, 0))) for s in STAGES}


def drop_stage(workdir: Path, stage: str) -> None:
    """Forget a stage and everything downstream, so the next run builds it from scratch."""
    for s in STAGES[STAGES.index(stage):]:
        shutil.rmtree(workdir / "artifacts" / s, ignore_errors=True)


def delays_for(rng: random.Random, duration: float, n: int) -> list[float]:
    """Kill points spread over the stage's working time (a little past it, so some land after the publish)."""
    return [round(rng.uniform(0, 1.1 * duration), 2) for _ in range(n)]


def summary(kills: list[Kill]) -> str:
    rows = []
    for stage in STAGES:
        ks = [k for k in kills if k.stage == stage]
        if ks:
            n = {w: sum(k.landed == w for k in ks) for w in ("before", "during", "after")}
            rows.append(f"{stage}: {len(ks)} kills ({n['before']} before its build, {n['during']} during it, "
                        f"{n['after']} after publishing)")
    return "; ".join(rows)
