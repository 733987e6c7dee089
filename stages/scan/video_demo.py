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

import torch
from PIL import Image, ImageDraw

from tuneline.schemas.demo import DEMO_COLORS, RGB
from tuneline.stages.scan import demo

VIDEO_VERSION = "video-1"
SIZE = (64, 64)
FRAMES, FPS = 17, 16  # Wan's shortest frame budget (4k+1) at its training frame rate: one second
# Unit steps (x, y) in image coordinates (y grows downwards), in the order the showcase and the check take them.
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
# One square size, near the middle across the motion, on a dark background: the tiny Wan flavor's VAE is random
# init, so its latents keep the motion only where little else varies (and a bright square on dark varies most).
EDGE = 20  # pixels: large enough to survive the VAE's 8x downsampling
JITTER = 4  # pixels the square's place across the motion varies by
BACKGROUND = (20, 60)  # grey levels
TRAVEL = 34  # pixels the square moves over the clip (2 per frame): several latent cells
VARIANTS = 3  # per (color, direction): 4 x 4 x 3 = 48 clips, one bucket


def caption(color: str, direction: str) -> str:
    return f"a {color} square moving {direction}"


def draw_clip(color: str, direction: str, rng: random.Random) -> list[Image.Image]:
    """FRAMES frames of one square crossing the frame in `direction` at a constant speed."""
    w, h = SIZE
    dx, dy = DIRECTIONS[direction]
    bg, edge = rng.randint(*BACKGROUND), EDGE
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


def demo_clips() -> torch.Tensor:
    """One clip per direction, the colors in turn, (4, 3, FRAMES, 64, 64) in [-1, 1]: what the tiny Wan flavor
    measures its latent statistics on, the way released ones were measured on the videos the model is for."""
    import numpy as np

    rng = random.Random(1)
    clips = [draw_clip(DEMO_COLORS[i], d, rng) for i, d in enumerate(DIRECTIONS)]
    pixels = torch.from_numpy(np.stack([np.stack([np.asarray(f) for f in c]) for c in clips]))
    return pixels.permute(0, 4, 1, 2, 3).float() / 127.5 - 1


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
    from tuneline.stages.validate.clips import write_mp4

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
