"""How long one optimizer step takes, measured: the training prints it once the first steps are done (the first
step carries the warm-up: allocations, kernel selection, the feed's first blocks, so it is timed but left out), the
train manifest records it (`step_seconds`), and `tuneline plan CONFIG` shows the newest such figure for the config
it plans. Checkpoints, renders and eval between steps are not part of a step's time."""

from __future__ import annotations

import json
import statistics
import time

WARMUP = 1  # steps timed but not counted: the first carries the run's warm-up
EARLY = 2  # steps measured after the warm-up before the early pace line
# Train settings that change how many steps run or what happens between them, not the work of one step.
NOT_PER_STEP = ("steps", "checkpoint_every", "keep_checkpoints", "validate_every", "checkpoint_minutes", "resume")


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`: a wait as people read it."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class PaceMeter:
    """Wall time of each optimizer step of this run (from before its first micro-batch to after the optimizer)."""

    def __init__(self, first_step: int, steps: int):
        self.first, self.steps = first_step, steps
        self.times: list[float] = []
        self.started = time.monotonic()

    def start(self) -> None:
        self.started = time.monotonic()

    def stop(self) -> None:
        self.times.append(time.monotonic() - self.started)

    def step_seconds(self) -> float | None:
        """The median step after the warm-up; None before one is measured."""
        counted = self.times[WARMUP:]
        return statistics.median(counted) if counted else None

    def early_line(self, step: int) -> str | None:
        """Once, when the first steps after the warm-up are measured: their pace and the time the rest takes."""
        if len(self.times) != WARMUP + EARLY or step >= self.steps:
            return None
        per = self.step_seconds()
        return (
            f"pace: {per:.3g} s/step measured over steps {self.first + WARMUP + 1}-{step} (step {self.first + 1}, "
            f"with the warm-up, took {self.times[0]:.3g} s): the {self.steps - step} steps left take about "
            f"{duration(per * (self.steps - step))}, checkpoints and renders besides"
        )


def measured_line(cfg, train_config: dict) -> str:
    """The plan's time per step: from the newest train version in the workdir trained with this train and model
    config (steps and intervals aside), or where it will be measured."""
    root = cfg.workdir_path() / "artifacts" / "train"
    want = comparable(train_config)
    found = []
    for manifest in root.glob("[!.]*/manifest.json"):
        try:
            m = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if m.get("step_seconds") and comparable(m.get("config", {})) == want:
            found.append((m.get("created_at", ""), manifest.parent.name, m))
    if not found:
        return (
            "time per step: not measured yet for this config in this workdir; the train stage prints it after its "
            f"first {WARMUP + EARLY} steps (`pace: …`) and records it in the train manifest (step_seconds)"
        )
    _, version, m = max(found)
    per = m["step_seconds"]
    return (
        f"time per step: {per:.3g} s, measured by train version {version} ({m['world_size']} process(es), global "
        f"batch {m['global_batch']}, on the latents version {m.get('upstream', {}).get('latents', '?')[:12]}): "
        f"{cfg.train.steps} steps take about {duration(per * cfg.train.steps)}"
    )


def comparable(config: dict) -> dict:
    train = {k: v for k, v in config.get("train", {}).items() if k not in NOT_PER_STEP}
    return {**config, "train": train}
