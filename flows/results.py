"""A run's results as Prefect artifacts: the validation grid labelled with its prompts, the loss curve and the
learning figures.

The validate and train stage runs show them, and the pipeline run shows them again as its own artifacts, so the
page of the run a user started holds its results. Pictures are inline data: URIs (the UI renders them with no web
server; a browser will not open a link to one); links go only to absolute URLs a browser can reach
(`ops.report_url`, or a signed URL of the pushed copy), never to a relative path or a local file.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from PIL import Image

from tuneline.schemas.config import PipelineConfig
from tuneline.stages.common import markdown as md

PLOT_WIDTH, PLOT_HEIGHT = 60, 10
THUMB_SIDE, THUMB_BYTES = 768, 150_000  # an artifact is stored in Prefect's database: keep each image small
# Per-image tiles beside their prompts: small, and only for the first prompts of a long list (the grid above
# shows them all).
TILE_SIDE, TILE_BYTES, MAX_TILES = 192, 30_000, 24
CLIP_BYTES = 120_000  # a validation clip's animated tile (a video family)
LEARNING = (
    "color_accuracy",
    "class_separation_accuracy",
    "edit_color_accuracy",
)


def image_url(cfg: PipelineConfig, stage: str, version: str, rel: str) -> str | None:
    """An absolute URL a browser reaches for a published file, or None."""
    if cfg.ops.report_url:
        return f"{cfg.ops.report_url.rstrip('/')}/{stage}/{version}/{rel}"
    if cfg.ops.remote:
        from tuneline.stages.common.remote import Remote

        return Remote(cfg.ops.remote, cfg.ops.remote_options).signed_url(stage, version, rel)
    return None


def inline_png(file: Path, side: int = THUMB_SIDE, max_bytes: int = THUMB_BYTES) -> str | None:
    """A data:image/png;base64 thumbnail of file, halved until it fits max_bytes; None when unreadable."""
    try:
        img = Image.open(file).convert("RGB")
    except OSError:
        return None
    img.thumbnail((side, side))
    while True:
        buf = io.BytesIO()
        img.save(buf, format="PNG", optimize=True)
        if buf.tell() <= max_bytes or min(img.size) < 32:
            return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        img = img.resize((max(1, img.width // 2), max(1, img.height // 2)))


def inline_animation(file: Path, side: int = TILE_SIDE, max_bytes: int = CLIP_BYTES) -> str | None:
    """A data:image/webp;base64 animated thumbnail of an animated WebP/GIF (a validation clip), frames dropped and
    sizes halved until it fits max_bytes; None when unreadable."""
    try:
        with Image.open(file) as im:
            durations = []
            frames = []
            for i in range(getattr(im, "n_frames", 1)):
                im.seek(i)
                frames.append(im.convert("RGB"))
                durations.append(im.info.get("duration", 100))
    except OSError:
        return None
    for f in frames:
        f.thumbnail((side, side))
    step = 1
    while True:
        buf = io.BytesIO()
        kept = frames[::step]
        kept[0].save(buf, "WEBP", save_all=True, append_images=kept[1:], duration=durations[0] * step, loop=0)
        if buf.tell() <= max_bytes or len(kept) < 3:
            return "data:image/webp;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        step *= 2


def grid_markdown(cfg: PipelineConfig, path: Path, m: dict) -> str:
    """The grid inline, then one row per image: its tile, prompt (an edit's instruction, beside its control),
    negative prompt and seed."""
    grid = m.get("grid", "grid.png")
    url = image_url(cfg, "validate", path.name, grid)
    thumb = inline_png(path / grid)
    head = [f"![grid]({thumb})"] if thumb else []
    head += [f"[full size]({url})"] if url else []
    controls = m.get("controls") or []  # an edit family: each row's control (input) beside its result
    if controls:
        rows = ["| control | result | instruction | seed |", "|---|---|---|---|"]
        rows += [
            f"| {_tile(cfg, path, controls[n], n)} | {_tile(cfg, path, i['file'], n)} | {md.text(i['prompt'])} | "
            f"{i['seed']} |"
            for n, i in enumerate(m.get("images", []))
        ]
        head.append("each row of the grid: control | result")
    else:
        rows = ["| image | prompt | negative prompt | seed |", "|---|---|---|---|"]
        rows += [
            f"| {_tile(cfg, path, i['file'], n)} | {md.text(i['prompt'])} | {md.text(i['negative_prompt'])} | {i['seed']} |"
            for n, i in enumerate(m.get("images", []))
        ]
    return "\n\n".join([*head, "\n".join(rows)])


def _tile(cfg: PipelineConfig, path: Path, rel: str, n: int) -> str:
    show = inline_animation if rel.endswith(".webp") else lambda f: inline_png(f, TILE_SIDE, TILE_BYTES)
    thumb = show(path / rel) if n < MAX_TILES else None
    shown = f"![{rel}]({thumb})" if thumb else f"`{rel}`"
    url = image_url(cfg, "validate", path.name, rel)
    return f"[{shown}]({url})" if url else shown


def loss_markdown(losses: list[float]) -> str:
    head = (
        f"first {losses[0]:.4f}, last {losses[-1]:.4f}, min {min(losses):.4f} "
        f"(mean of the last {min(10, len(losses))}: {_mean(losses[-10:]):.4f})"
    )
    return f"{head}\n\n```\n{loss_plot(losses)}\n```"


def loss_plot(losses: list[float], width: int = PLOT_WIDTH, height: int = PLOT_HEIGHT) -> str:
    """A text chart (renders anywhere, needs no image URL): one column per bucket of steps, mean loss."""
    n = len(losses)
    cols = min(width, n)
    means = [_mean(losses[i * n // cols : (i + 1) * n // cols]) for i in range(cols)]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    levels = [round((v - lo) / span * (height - 1)) for v in means]
    rows = []
    for level in range(height - 1, -1, -1):
        label = f"{lo + span * level / (height - 1):9.4f} |" if level in (0, height - 1) else " " * 10 + "|"
        rows.append(label + "".join("*" if lv == level else " " for lv in levels))
    rows.append(" " * 10 + "+" + "-" * cols)
    rows.append(" " * 11 + f"step 1 .. {n}")
    return "\n".join(rows)


def train_loss_markdown(cfg: PipelineConfig, path: Path, m: dict) -> str:
    """The loss curve picture inline (its eval losses too), a link when a URL reaches it, and the text chart."""
    rel = m.get("loss_curve", "loss.png")
    thumb, url = inline_png(path / rel), image_url(cfg, "train", path.name, rel)
    parts = ([f"![loss]({thumb})"] if thumb else []) + ([f"[full size]({url})"] if url else [])
    return "\n\n".join([*parts, loss_markdown(m["losses"])])


def learning_rows(final_loss: float | None, validate: dict) -> list[dict]:
    """What the run learned: the final loss (as the run's summary defines it) and, where measured (the demos), each
    check of the trained model beside the untrained one's."""
    from tuneline.flows.summary import FINAL_WINDOW

    rows = []
    if final_loss is not None:
        figure = f"final loss (training loss, mean of the last {FINAL_WINDOW} steps)"
        rows.append({"figure": figure, "trained": round(final_loss, 4), "untrained": ""})
    for key in LEARNING:
        if validate.get(key) is not None:
            rows.append({"figure": key, "trained": validate[key], "untrained": validate.get(f"untrained_{key}", "")})
    return rows


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)
