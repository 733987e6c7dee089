"""What `tuneline run` prints at the end: per stage built or reused and its time, the final loss, the learning
figures of validation and where the grid and the trained weights are."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

LEARNING = (
    "color_accuracy",
    "untrained_color_accuracy",
    "class_separation_accuracy",
    "untrained_class_separation_accuracy",
)


def timed_stage(run: Callable[[], str]) -> dict:
    """Run one stage flow; it was built when its manifest was written after the call started."""
    start = time.time()
    path = str(run())
    try:
        built = (Path(path) / "manifest.json").stat().st_mtime >= start
    except OSError:
        built = False
    return {"path": path, "seconds": round(time.time() - start, 1), "built": built}


def summary_lines(runs: dict[str, dict]) -> list[str]:
    lines = [
        f"{name:9s} {'built ' if r['built'] else 'reused'} {r['seconds']:7.1f} s  {r['path']}"
        for name, r in runs.items()
    ]
    lines += rejected_lines(runs)
    train = _manifest(runs.get("train"))
    final = final_loss(Path(runs["train"]["path"])) if runs.get("train") else None
    if final is not None:
        lines.append(
            f"final loss: {final:.4f} (training loss averaged over the last {min(FINAL_WINDOW, train.get('step', 0))}"
            f" steps, as the last step line; after {train.get('step')} steps)"
        )
    validate = _manifest(runs.get("validate"))
    figures = [f"{k} {validate[k]}" for k in LEARNING if validate.get(k) is not None]
    if figures:
        lines.append("learning: " + ", ".join(figures))
    if runs.get("validate"):
        lines.append(f"grid: {Path(runs['validate']['path']) / validate.get('grid', 'grid.png')}")
    if runs.get("train"):
        lines.append(f"final weights: {Path(runs['train']['path']) / 'final'}")
    return lines


# The window the training's step lines average the loss over (tuneline.stages.train.hooks.LOG_EVERY, not imported:
# that module imports torch, and the summary of a no-op run must stay cheap).
FINAL_WINDOW = 10


def final_loss(train_dir: Path) -> float | None:
    """The mean training loss of the last FINAL_WINDOW steps (losses.jsonl has every step's), or None."""
    try:
        tail = (train_dir / "losses.jsonl").read_text(encoding="utf-8").splitlines()[-FINAL_WINDOW:]
        values = [json.loads(line)["loss"] for line in tail]
    except (OSError, ValueError, KeyError):
        return None
    return sum(values) / len(values) if values else None


def rejected_lines(runs: dict[str, dict]) -> list[str]:
    """How many images the scan (and the latents cache) left out, and the file that lists them with reasons."""
    out = []
    for name in ("scan", "latents"):
        m = _manifest(runs.get(name))
        if name == "scan" or m.get("rejected"):
            if m:
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(m.get("rejected_by_kind", {}).items()))
                out.append(
                    f"rejected images ({name}): {m.get('rejected', 0)}"
                    + (f" ({kinds})" if kinds else "")
                    + f", listed in {Path(runs[name]['path']) / 'rejected.jsonl'}"
                )
    return out


def _manifest(run: dict | None) -> dict:
    try:
        return json.loads((Path(run["path"]) / "manifest.json").read_text(encoding="utf-8")) if run else {}
    except (OSError, ValueError):
        return {}
