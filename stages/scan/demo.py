"""The demo's generated dataset: one colored shape per image on a plain light background, captioned.

Colors are the learning check's classes, so the shape is large (its color dominates the image and so the
mean latent of its class); the background and shade vary a little so the model sees more than one image.
"""

from __future__ import annotations

import json
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
FILES = ".tuneline-demo-files.json"  # the manifest of what the demo wrote: the only files it ever deletes
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


def _stems() -> list[tuple[str, str, tuple[int, int], str]]:
    return [
        (color, shape, (w, h), f"{color}_{shape}_{w}x{h}_{i}")
        for color in DEMO_COLORS
        for shape in DEMO_SHAPES
        for w, h in SIZES
        for i in range(VARIANTS)
    ]


def _write_all(target: Path) -> None:
    rng = random.Random(0)
    written = []
    for color, shape, size, stem in _stems():
        _draw(color, shape, size, rng).save(target / f"{stem}.png")
        (target / f"{stem}.txt").write_text(f"a {color} {shape}\n", encoding="utf-8")
        written += [f"{stem}.png", f"{stem}.txt"]
    finish(target, written, DEMO_VERSION)


def finish(target: Path, written: list[str], version: str) -> None:
    """Record what a demo wrote into `target` (the only files ever deleted) and mark it complete."""
    (target / FILES).write_text(json.dumps(written), encoding="utf-8")
    (target / MARKER).write_text(version, encoding="utf-8")


def demo_files(root: Path) -> set[str]:
    """Names the demo wrote into `root`: its manifest, or for a folder from before manifests the names that
    version wrote (they never changed)."""
    try:
        names = json.loads((root / FILES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        names = [f"{stem}{ext}" for *_, stem in _stems() for ext in (".png", ".txt")]
    return {n for n in names if isinstance(n, str) and "/" not in n and n not in ("", ".", "..")} | {MARKER, FILES}


def _remove_stale_demo(root: Path) -> None:
    """Delete an older or incomplete demo in `root`, file by file from its manifest; refuse, deleting nothing,
    when the folder holds anything else (the user's files)."""
    ours = demo_files(root)
    others = sorted(e.name for e in os.scandir(root) if e.name not in ours or not e.is_file(follow_symlinks=False))
    if others:
        raise ConfigError(
            f"dataset.path {root} holds an outdated tuneline demo plus files the demo did not write "
            f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}); they are never deleted: "
            f"move them out, or point dataset.path elsewhere"
        )
    for name in ours:
        (root / name).unlink(missing_ok=True)
    root.rmdir()  # empty now; fails rather than delete anything that appeared meanwhile


def leftovers(root: Path) -> list[Path]:
    """Build folders (`.<name>.tmp-PID`) that killed demo generations left beside `root`: their process is gone."""
    out = []
    for tmp in sorted(Path(root).parent.glob(f".{Path(root).name}.tmp-*")):
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _alive(int(pid)) and tmp.is_dir() and not tmp.is_symlink():
            out.append(tmp)
    return out


def remove_leftovers(root: Path) -> None:
    for tmp in leftovers(root):
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_complete(root: Path, version: str = DEMO_VERSION) -> bool:
    try:
        return (root / MARKER).read_text(encoding="utf-8").strip() == version
    except (FileNotFoundError, NotADirectoryError):
        return False


def write_demo_dataset(root: Path) -> None:
    """Write the demo dataset to `root` unless it is already there (idempotent).

    Built in a hidden sibling and renamed into place, so a killed run leaves no half dataset (and the next run
    removes that sibling). Only files the demo wrote are ever deleted (its manifest): a folder holding anything
    else is left as it is and the user is told to pick another path.
    """
    root = Path(root)
    if is_complete(root):
        if root.parent.is_dir():
            remove_leftovers(root)
        return
    clear(root)
    build_into([root], _write_all)


def clear(root: Path, field: str = "dataset.path") -> None:
    """Make way for a demo in `root`: remove killed generations' leftovers and an older demo (its own files
    only); refuse a folder holding anything else."""
    if root.parent.is_dir():
        remove_leftovers(root)
    if root.exists():
        if not (root / MARKER).is_file() and any(root.iterdir()):
            raise ConfigError(
                f"{field} {root} exists and is not a tuneline demo dataset; with "
                f"dataset.demo true it must be empty or missing: point {field} elsewhere "
                f"or set dataset.demo false to scan it as it is"
            )
        _remove_stale_demo(root)  # an empty folder, or an older demo version: only its own files go


def build_into(roots: list[Path], write) -> None:
    """`write(*folders)` into hidden siblings of `roots`, then each renamed into place: a killed run leaves no
    half dataset (and the next run removes the siblings)."""
    tmps = []
    try:
        for root in roots:
            root.parent.mkdir(parents=True, exist_ok=True)
            tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            tmps.append(tmp)
        write(*tmps)
        for tmp, root in zip(tmps, roots):
            os.replace(tmp, root)
    except BaseException:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_demo_for(cfg) -> None:
    """The demo dataset `cfg.dataset.demo` asks for: the colored shapes, (edit) pairs in dataset.path and
    dataset.control, or (video) moving squares."""
    if cfg.dataset.demo == "video":
        from tuneline.stages.scan.video_demo import write_video_demo

        write_video_demo(cfg.resolve(cfg.dataset.path))
    elif cfg.dataset.demo == "edit":
        from tuneline.stages.scan.edit_demo import write_edit_demo

        write_edit_demo(cfg.resolve(cfg.dataset.path), cfg.resolve(cfg.dataset.control))
    else:
        write_demo_dataset(cfg.resolve(cfg.dataset.path))
