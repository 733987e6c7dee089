"""Benchmark: how long a refused `tuneline run` / `tuneline stage` takes, as users run it (a fresh process each).

A refusal is decided from the config and the artifact store before any Prefect server starts (and without
importing prefect, torch or diffusers), so it should answer in about the time `tuneline status` takes. Cases, on
a copy of the demo's dataset as a user dataset (`dataset.demo: false`):
- `run` with a `dataset.path` that does not exist; `stage scan` with a `model.path` that does not exist;
- `stage train` in a fresh workdir (scan, latents and text missing: all named in one message);
- `stage validate` after `stage scan` (latents, text and train missing), with the scan's hash cache warm, as
  after a first run (the tiny model has no model file to hash; a real one's hashes are cached the same way).
Each case runs once untimed (the model identity is then cached, as after a first run), then three times; the
RESULT is the slowest median wall time in seconds (goal <= 2). CPU seconds are printed beside it, and a bare
`python -c pass` start as the floor any command pays on this machine.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
GOAL = 2.0


def tuneline(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuneline.flows.cli", *args], cwd=ROOT, capture_output=True, text=True)


def write_config(path: Path, **edits: dict) -> Path:
    cfg = yaml.safe_load(tuneline("config", "example").stdout)
    for section, values in edits.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_refusal(args: list[str], must_name: list[str]) -> tuple[float, float]:
    # One untimed call first: the first status of a workdir computes the model's identity once (hashing a model
    # file, or materializing the tiny model) and caches it, as any first run does.
    tuneline(*args)
    times, cpu = [], []
    for _ in range(3):
        started, cpu0 = time.perf_counter(), _cpu()
        out = tuneline(*args)
        times.append(time.perf_counter() - started)
        cpu.append(_cpu() - cpu0)
        msg = out.stderr.strip()
        if out.returncode == 0 or not all(n in msg for n in must_name) or len(msg.splitlines()) != 1:
            sys.exit(f"`tuneline {' '.join(args)}` was not refused as expected (rc {out.returncode}):\n{msg[-2000:]}")
    return statistics.median(times), statistics.median(cpu)


def main() -> None:
    from tuneline.stages.scan.demo import write_demo_dataset

    tmp = Path(tempfile.mkdtemp(prefix="tuneline-bench-refusal-"))
    data = tmp / "data"
    write_demo_dataset(data)
    good = write_config(tmp / "good.yaml", dataset={"path": str(data), "demo": False})
    no_data = write_config(tmp / "no-data.yaml", dataset={"path": str(tmp / "missing"), "demo": False})
    no_model = write_config(
        tmp / "no-model.yaml",
        dataset={"path": str(data), "demo": False},
        model={"path": str(tmp / "missing.safetensors")},
    )
    fresh, scanned = tmp / "fresh", tmp / "scanned"
    print("building a scan for the last case (one real `tuneline stage scan`)", flush=True)
    scan = tuneline("stage", "scan", str(good), "--workdir", str(scanned))
    if scan.returncode != 0:
        sys.exit(f"`tuneline stage scan` failed:\n{scan.stderr[-3000:]}")
    cases = {
        "run, dataset.path missing": (["run", str(no_data), "--workdir", str(fresh)], ["dataset.path"]),
        "stage scan, model.path missing": (["stage", "scan", str(no_model), "--workdir", str(fresh)], ["model.path"]),
        "stage train, fresh workdir": (
            ["stage", "train", str(good), "--workdir", str(fresh)],
            ["scan", "latents", "text", "--until train"],
        ),
        "stage validate after scan": (
            ["stage", "validate", str(good), "--workdir", str(scanned)],
            ["latents", "text", "train", "--until validate"],
        ),
    }
    medians = {}
    for name, (args, must_name) in cases.items():
        medians[name], cpu = timed_refusal(args, must_name)
        # CPU seconds beside the wall time: on a shared machine the wall time mostly measures the other load
        print(f"{name}: median {medians[name]:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    if fresh.exists():
        sys.exit(f"a refused command wrote {fresh}")
    floor = statistics.median(_bare_start() for _ in range(3))
    slowest = max(medians.values())
    print(f"python start alone: {floor:.2f} s")
    print(f"RESULT refusal_seconds {slowest:.3f} goal <= {GOAL} {'PASS' if slowest <= GOAL else 'FAIL'}")


def _bare_start() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
