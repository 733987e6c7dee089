"""Benchmark: a `tuneline run` with nothing to do, against the full run that built everything.

A scheduled run on an unchanged folder should cost close to nothing. This builds a 1,000-image demo-style
dataset (one colored shape per image, captioned), runs the pipeline once with the demo's config on it
(`train.steps: 100`), then times `tuneline run` again, everything fresh, as a user's command runs: a new process,
the default (ephemeral) Prefect. The same for the built-in demo. Both times are wall clock of the whole command,
interpreter start included. `noop_vs_full` = no-op seconds / full-run seconds.
"""

from __future__ import annotations

import copy
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tuneline.schemas.demo import DEMO_CONFIG  # noqa: E402

IMAGES = 1000
STEPS = 100
GOAL = 0.05
COLORS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (235, 215, 30)}
SIZES = ((64, 64), (96, 64), (64, 96))


def make_dataset(folder: Path) -> None:
    folder.mkdir(parents=True)
    rng = random.Random(0)
    for i in range(IMAGES):
        color, shape = rng.choice(list(COLORS)), rng.choice(["circle", "square"])
        w, h = rng.choice(SIZES)
        bg = rng.randint(200, 245)
        img = Image.new("RGB", (w, h), (bg, bg, bg))
        edge = int(min(w, h) * rng.uniform(0.6, 0.9))
        left, top = rng.randint(0, w - edge), rng.randint(0, h - edge)
        box = (left, top, left + edge - 1, top + edge - 1)
        draw = ImageDraw.Draw(img)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLORS[color])
        img.save(folder / f"img{i:05d}.png")
        (folder / f"img{i:05d}.txt").write_text(f"a {color} {shape}")


def timed_run(*args: str) -> float:
    """`tuneline run ARGS` in a fresh process; its wall time."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = str(ROOT)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "tuneline.flows.cli", "run", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"tuneline run {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return seconds


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tuneline-noop-") as tmp:
        root = Path(tmp)
        demo_full = timed_run("--workdir", str(root / "demo"))
        demo_noop = timed_run("--workdir", str(root / "demo"))
        print(f"demo: full run {demo_full:.1f} s, no-op run {demo_noop:.1f} s ({demo_noop / demo_full:.3f})")

        make_dataset(root / "photos")
        cfg = copy.deepcopy(DEMO_CONFIG)
        cfg["workdir"] = str(root / "work")
        cfg["dataset"] = {**cfg["dataset"], "path": str(root / "photos"), "demo": False}
        cfg["train"] = {**cfg["train"], "steps": STEPS}
        cfg["validate"] = {**cfg.get("validate", {}), "learning_check": False}
        path = root / "config.yaml"
        path.write_text(yaml.safe_dump(cfg))
        full = timed_run(str(path))
        noop = timed_run(str(path))
    print(f"{IMAGES} images, {STEPS} steps: full run {full:.1f} s, no-op run {noop:.1f} s")
    ratio = noop / full
    print(f"RESULT noop_vs_full {ratio:.3f} goal <= {GOAL} {'PASS' if ratio <= GOAL else 'FAIL'}")


if __name__ == "__main__":
    main()
