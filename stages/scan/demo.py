"""The demo's generated dataset: one colored shape per image on a plain light background, captioned.

Colors are the learning check's classes, so the shape is large (its color dominates the image and so the
mean latent of its class); the background and shade vary a little so the model sees more than one image.
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

from tuneline.schemas.config import ConfigError
from tuneline.schemas.demo import DEMO_COLORS, DEMO_SHAPES, RGB

# Bump when the generated content changes: an older demo folder is then regenerated, never mixed.
DEMO_VERSION = "1"
MARKER = ".tuneline-demo"
SIZES = ((64, 64), (96, 64), (64, 96))
VARIANTS = 3  # per (color, shape, size): 4 colors x 2 shapes x 3 sizes x 3 = 72 images, 24 per bucket


def _draw(color: str, shape: str, size: tuple[int, int], rng: random.Random) -> Image.Image:
    w, h = size
    bg = rng.randint(200, 245)
    img = Image.new("RGB", size, (bg, bg, bg))
    fill = tuple(max(0, min(255, c + rng.randint(-15, 15))) for c in RGB[color])
    edge = int(min(w, h) * rng.uniform(0.85, 0.95))
    left = rng.randint(0, w - edge)
    top = rng.randint(0, h - edge)
    box = (left, top, left + edge - 1, top + edge - 1)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.rectangle(box, fill=fill)
    return img


def _write_all(target: Path) -> None:
    rng = random.Random(0)
    for color in DEMO_COLORS:
        for shape in DEMO_SHAPES:
            for w, h in SIZES:
                for i in range(VARIANTS):
                    stem = f"{color}_{shape}_{w}x{h}_{i}"
                    _draw(color, shape, (w, h), rng).save(target / f"{stem}.png")
                    (target / f"{stem}.txt").write_text(f"a {color} {shape}\n", encoding="utf-8")
    (target / MARKER).write_text(DEMO_VERSION, encoding="utf-8")


def is_complete(root: Path) -> bool:
    try:
        return (root / MARKER).read_text(encoding="utf-8").strip() == DEMO_VERSION
    except (FileNotFoundError, NotADirectoryError):
        return False


def write_demo_dataset(root: Path) -> None:
    """Write the demo dataset to `root` unless it is already there (idempotent).

    Built in a hidden sibling and renamed into place, so a killed run leaves no half dataset. A folder that
    exists but is not ours is never deleted: the user is told to pick another path.
    """
    root = Path(root)
    if is_complete(root):
        return
    if root.exists():
        if not (root / MARKER).is_file() and any(root.iterdir()):
            raise ConfigError(f"dataset.path {root} exists and is not a tuneline demo dataset; with "
                                  f"dataset.demo true it must be empty or missing: point dataset.path elsewhere "
                                  f"or set dataset.demo false to scan it as it is")
        shutil.rmtree(root)  # an empty folder, or an older demo version: ours to replace
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_all(tmp)
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
