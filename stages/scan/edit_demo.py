"""The edit demo (dataset.demo: edit): pairs of shapes where the instruction changes the color.

Each pair is a control (a shape in one demo color) and a target (the same shape, place and background in another
color), captioned "make it <color>". The edit learning check (stages/validate/edits.py) renders new controls with
each instruction and asks whether the result has the instructed color. Both folders are written beside each other
the way the shapes demo writes its one (stages/scan/demo.py: a hidden sibling renamed into place, only its own
files ever deleted).
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

from tuneline.schemas.demo import DEMO_COLORS, DEMO_SHAPES, RGB
from tuneline.stages.scan import demo

EDIT_VERSION = "edit-1"
SIZE = (64, 64)
VARIANTS = 2  # per (from color, to color, shape): 4 x 3 x 2 x 2 = 48 pairs, one bucket


def instruction(color: str) -> str:
    return f"make it {color}"


def draw_pair(source: str, target: str, shape: str, rng: random.Random) -> tuple[Image.Image, Image.Image]:
    """(control, target): one shape at one place on one background, in the source and the target color."""
    w, h = SIZE
    bg = rng.randint(200, 245)
    edge = int(min(w, h) * rng.uniform(0.6, 0.8))
    left, top = rng.randint(0, w - edge), rng.randint(0, h - edge)
    box = (left, top, left + edge - 1, top + edge - 1)
    out = []
    for color in (source, target):
        img = Image.new("RGB", SIZE, (bg, bg, bg))
        draw = ImageDraw.Draw(img)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=RGB[color])
        out.append(img)
    return out[0], out[1]


def pairs() -> list[tuple[str, str, str, str]]:
    """(stem, source color, target color, shape) of every pair."""
    return [
        (f"{s}_to_{t}_{shape}_{i}", s, t, shape)
        for s in DEMO_COLORS
        for t in DEMO_COLORS
        if s != t
        for shape in DEMO_SHAPES
        for i in range(VARIANTS)
    ]


def check_controls(seeds: int) -> list[tuple[str, Image.Image]]:
    """(instructed color, control) of the learning check: per demo color, `seeds` controls of another color,
    drawn apart from the training pairs (another generator)."""
    rng = random.Random(1000)
    out = []
    for n, target in enumerate(DEMO_COLORS):
        others = [c for c in DEMO_COLORS if c != target]
        for i in range(seeds):
            control, _ = draw_pair(others[i % len(others)], target, DEMO_SHAPES[(n + i) % len(DEMO_SHAPES)], rng)
            out.append((target, control))
    return out


def showcase(n: int) -> list[tuple[str, Image.Image]]:
    """(instruction, control) of the edit demo's `n` validation rows: the instructed color in turn through every
    demo color, each on a control of another color (the source color in turn too) and the shapes alternating,
    drawn apart from the training pairs and the learning check (another generator)."""
    rng = random.Random(2000)
    out = []
    for i in range(n):
        target = DEMO_COLORS[i % len(DEMO_COLORS)]
        others = [c for c in DEMO_COLORS if c != target]
        source = others[(i + i // len(DEMO_COLORS)) % len(others)]
        control, _ = draw_pair(source, target, DEMO_SHAPES[i % len(DEMO_SHAPES)], rng)
        out.append((instruction(target), control))
    return out


def _write(targets: Path, controls: Path) -> None:
    rng = random.Random(0)
    written, written_controls = [], []
    for stem, s, t, shape in pairs():
        control, target = draw_pair(s, t, shape, rng)
        target.save(targets / f"{stem}.png")
        control.save(controls / f"{stem}.png")
        (targets / f"{stem}.txt").write_text(instruction(t) + "\n", encoding="utf-8")
        written += [f"{stem}.png", f"{stem}.txt"]
        written_controls.append(f"{stem}.png")
    demo.finish(targets, written, EDIT_VERSION)
    demo.finish(controls, written_controls, EDIT_VERSION)


def write_edit_demo(targets: Path, controls: Path) -> None:
    """Write the pairs to `targets` and `controls` unless both are already there (idempotent)."""
    if demo.is_complete(targets, EDIT_VERSION) and demo.is_complete(controls, EDIT_VERSION):
        return
    demo.clear(targets)
    demo.clear(controls, "dataset.control")
    demo.build_into([targets, controls], _write)
