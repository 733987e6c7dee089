"""The video demo (dataset.demo: video): short clips of one colored square moving across a plain dark background,
each captioned with its color and the direction it moves ("a red square moving left").

The directions are the motion learning check's classes (stages/validate/motion.py): it renders new clips for each
direction and asks whether the square in them moves the prompted way. Written as the shapes demo writes its
images (stages/scan/demo.py: a hidden sibling renamed into place, only its own files ever deleted); the same
generator seed always writes the same clips.
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

from tuneline.schemas.demo import (
    DEMO_COLORS,
    RGB,
    VIDEO_BACKGROUND,
    VIDEO_DIRECTIONS,
    VIDEO_EDGE,
    VIDEO_FPS,
    VIDEO_FRAMES,
    VIDEO_SIZE,
    VIDEO_TRAVEL,
)
from tuneline.stages.render.clipfile import write_mp4
from tuneline.stages.scan import demo

VIDEO_VERSION = "video-1"
SIZE, FRAMES, FPS, EDGE, TRAVEL = (VIDEO_SIZE, VIDEO_SIZE), VIDEO_FRAMES, VIDEO_FPS, VIDEO_EDGE, VIDEO_TRAVEL
DIRECTIONS = VIDEO_DIRECTIONS
JITTER = 4  # pixels the square's place across the motion varies by
VARIANTS = 3  # per (color, direction): 4 x 4 x 3 = 48 clips, one bucket


def caption(color: str, direction: str) -> str:
    return f"a {color} square moving {direction}"


def draw_clip(color: str, direction: str, rng: random.Random) -> list[Image.Image]:
    """FRAMES frames of one square crossing the frame in `direction` at a constant speed."""
    w, h = SIZE
    dx, dy = DIRECTIONS[direction]
    bg, edge = rng.randint(*VIDEO_BACKGROUND), EDGE
    # Along the motion the square starts where the whole travel stays inside the frame; across it near the middle.
    x0 = (w - edge - TRAVEL) // 2 + (TRAVEL if dx < 0 else 0) if dx else (w - edge) // 2 + rng.randint(-JITTER, JITTER)
    y0 = (h - edge - TRAVEL) // 2 + (TRAVEL if dy < 0 else 0) if dy else (h - edge) // 2 + rng.randint(-JITTER, JITTER)
    frames = []
    for i in range(FRAMES):
        shift = round(TRAVEL * i / (FRAMES - 1))
        left, top = x0 + dx * shift, y0 + dy * shift
        img = Image.new("RGB", SIZE, (bg, bg, bg))
        ImageDraw.Draw(img).rectangle((left, top, left + edge - 1, top + edge - 1), fill=RGB[color])
        frames.append(img)
    return frames


def clips() -> list[tuple[str, str, str]]:
    """(stem, color, direction) of every training clip."""
    return [
        (f"{color}_{direction}_{i}", color, direction)
        for color in DEMO_COLORS
        for direction in DIRECTIONS
        for i in range(VARIANTS)
    ]


def check_prompts(seeds: int) -> list[tuple[str, str]]:
    """(prompt, direction) of the motion check: `seeds` clips per direction, the colors in turn."""
    out = []
    for n, direction in enumerate(DIRECTIONS):
        for i in range(seeds):
            out.append((caption(DEMO_COLORS[(n + i) % len(DEMO_COLORS)], direction), direction))
    return out


def showcase(n: int) -> list[str]:
    """The video demo's `n` validation prompts: every direction in turn, each with another color."""
    return [caption(DEMO_COLORS[i % len(DEMO_COLORS)], list(DIRECTIONS)[i % len(DIRECTIONS)]) for i in range(n)]


def _write(root: Path) -> None:
    rng = random.Random(0)
    written = []
    for stem, color, direction in clips():
        write_mp4(draw_clip(color, direction, rng), root / f"{stem}.mp4", FPS)
        (root / f"{stem}.txt").write_text(caption(color, direction) + "\n", encoding="utf-8")
        written += [f"{stem}.mp4", f"{stem}.txt"]
    demo.finish(root, written, VIDEO_VERSION)


def write_video_demo(root: Path) -> None:
    """Write the clips to `root` unless they are already there (idempotent)."""
    if demo.is_complete(root, VIDEO_VERSION):
        return
    demo.clear(root)
    demo.build_into([root], _write)
